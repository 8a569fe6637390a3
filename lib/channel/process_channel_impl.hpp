#pragma once
// Internal: the backends behind ProcessChannel::open() (process_channel.cpp parses the URI and
// checks the directory; shm_channel.cpp and zmq_channel.cpp are the two kinds of ends).

#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/channel/detail/zmq_calls.hpp>  // poll_slice_ms(): a receive()'s waits
#include <blockflow/channel/process_channel.hpp>

#include <absl/status/statusor.h>
#include <absl/time/time.h>

#include <memory>
#include <string>

namespace blockflow::detail {

/// This user's rendezvous directory for shm:// and ipc://NAME channels, created 0700 when missing;
/// PermissionDenied naming `uri` when it exists but is not a directory of ours closed to others.
absl::StatusOr<std::string> channel_directory(const std::string& uri);

/// PermissionDenied naming `uri` unless `dir` is a directory (not a symlink) owned by this user
/// with no access for group or others.
absl::Status check_private_directory(const std::string& dir, const std::string& uri);

/// True when something accepts connections at the Unix socket `path` (a live receiver), trying
/// `type` (SOCK_STREAM for ZeroMQ's ipc://, SOCK_SEQPACKET for shm://).
bool unix_socket_live(const std::string& path, int type);

/// shm:// (and cuda://, `cuda`: CUDA tensors as CUDA IPC handles, CPU tensors through the slots):
/// the data link's socket at `socket_path`.
absl::StatusOr<std::unique_ptr<ProcessChannel>> open_shm_channel(const std::string& uri, const std::string& socket_path,
                                                                 ChannelRole role, const ProcessChannelOptions& options,
                                                                 bool cuda = false);
/// ipc:// and tcp://: `endpoint` as ZeroMQ spells it.
absl::StatusOr<std::unique_ptr<ProcessChannel>> open_zmq_channel(const std::string& uri, const std::string& endpoint,
                                                                 ChannelRole role, const ProcessChannelOptions& options);

/// The kData header of an envelope to send (stamped now).
wire::Header data_header(const Envelope& envelope);
/// The envelope a received kData message stands for (stamped now).
Envelope envelope_of(DecodedMessage&& message);

/// The outcome of a send that did not happen: the envelope goes back to the caller.
SendOutcome refused(Envelope&& envelope, absl::Status status);

/// `status` with the channel's URI in front of its message ("URI: message"), its code kept.
absl::Status named(const std::string& uri, const absl::Status& status);
/// empty()'s tensor, or its error with the channel's URI in front.
absl::StatusOr<at::Tensor> named(const std::string& uri, absl::StatusOr<at::Tensor> t);

}  // namespace blockflow::detail
