#include <blockflow/channel/detail/tensor_codec.hpp>
#include <blockflow/core/detail/sanitizer.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <memory>
#include <new>
#include <stdexcept>

namespace blockflow::detail {

absl::StatusOr<wire::DType> to_wire_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return wire::DType::kFloat32;
    case at::kDouble: return wire::DType::kFloat64;
    case at::kHalf: return wire::DType::kFloat16;
    case at::kBFloat16: return wire::DType::kBFloat16;
    case at::kChar: return wire::DType::kInt8;
    case at::kByte: return wire::DType::kUInt8;
    case at::kShort: return wire::DType::kInt16;
    case at::kInt: return wire::DType::kInt32;
    case at::kLong: return wire::DType::kInt64;
    case at::kBool: return wire::DType::kBool;
    default: return absl::InvalidArgumentError(fmt::format("dtype {} has no wire code", c10::toString(type)));
  }
}

absl::StatusOr<at::ScalarType> from_wire_dtype(wire::DType type) {
  switch (type) {
    case wire::DType::kFloat32: return at::kFloat;
    case wire::DType::kFloat64: return at::kDouble;
    case wire::DType::kFloat16: return at::kHalf;
    case wire::DType::kBFloat16: return at::kBFloat16;
    case wire::DType::kInt8: return at::kChar;
    case wire::DType::kUInt8: return at::kByte;
    case wire::DType::kInt16: return at::kShort;
    case wire::DType::kInt32: return at::kInt;
    case wire::DType::kInt64: return at::kLong;
    case wire::DType::kBool: return at::kBool;
  }
  return absl::InvalidArgumentError(fmt::format("wire dtype code {} unknown", static_cast<int>(type)));
}

absl::StatusOr<EncodedMessage> encode_message(wire::Header header, const Tensors& tensors, std::uint64_t* bytes_copied,
                                             const ShmStager* stager, const ShmUnstager* unstage) {
  EncodedMessage out;
  out.tensors.reserve(tensors.size());
  header.tensors.clear();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined()) return absl::InvalidArgumentError(fmt::format("tensor {} is undefined", i));
    if (t.layout() != at::kStrided) {  // sparse, mkldnn: no bytes of their own to send
      return absl::InvalidArgumentError(
          fmt::format("tensor {} has layout {}: channels carry dense (strided) tensors", i, fmt::streamed(t.layout())));
    }
    if (!t.device().is_cpu() && !t.device().is_meta() && stager == nullptr) {
      return absl::InvalidArgumentError(
          fmt::format("tensor {} is on {}: the serialized channel carries CPU tensors", i, t.device().str()));
    }
    auto dtype = to_wire_dtype(t.scalar_type());
    if (!dtype.ok()) return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, std::string(dtype.status().message())));
    // libtorch may refuse (a sparse tensor has no contiguous form), memory may run out, and an empty
    // tensor whose other dimensions overflow i64 has no contiguous strides: errors, never thrown out.
    try {
      at::Tensor c = t.contiguous();
      if (bytes_copied != nullptr && c.data_ptr() != t.data_ptr()) *bytes_copied += byte_size(c);
      wire::TensorDesc desc;
      desc.dtype = *dtype;
      desc.shape.assign(c.sizes().begin(), c.sizes().end());
      desc.strides = wire::contiguous_strides(desc.shape);
      desc.byte_count = byte_size(c);
      header.tensors.push_back(std::move(desc));
      out.tensors.push_back(std::move(c));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(fmt::format("tensor {}: out of memory", i));
    } catch (const c10::Error& e) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, e.what()));
    }
  }
  // Over a limit of the format (more than kMaxTensors outputs, more than kMaxDims dimensions): an
  // error for the caller to report, before any slot is staged.
  if (auto status = wire::encodable(header); !status.ok()) return status;
  if (stager != nullptr) {
    header.flags |= wire::kFlagShmHandles;
    for (std::size_t i = 0; i < out.tensors.size(); ++i) {
      auto handle = (*stager)(out.tensors[i]);
      if (!handle.ok()) {
        if (unstage != nullptr) {
          for (const auto& staged : out.staged) (*unstage)(staged);  // this message will not carry them
        }
        return absl::Status(handle.status().code(),
                            fmt::format("tensor {}: {}", i, std::string(handle.status().message())));
      }
      out.handles.push_back(wire::encode_shm_handle(*handle));
      out.staged.push_back(*handle);
    }
    out.tensors.clear();  // the handles stand for them (the stager keeps what must stay alive)
  }
  out.header = wire::encode_header(header);
  return out;
}

// The header, then the small frames (handles or parked references), then the tensors' bytes.
bool send_encoded(zmq::socket_t& socket, const EncodedMessage& encoded, zmq::send_flags flags) {
  const auto& handles = encoded.handles;
  const auto& owned = encoded.tensors;
  const std::size_t parts = handles.size() + owned.size();
  auto sent = socket.send(zmq::buffer(encoded.header), parts > 0 ? (flags | zmq::send_flags::sndmore) : flags);
  if (!sent) return false;
  // Later parts of a multipart message never block once the first part was accepted.
  for (std::size_t i = 0; i < handles.size(); ++i) {
    (void)socket.send(zmq::buffer(handles[i]), i + 1 < handles.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  for (std::size_t i = 0; i < owned.size(); ++i) {
    // The frame keeps a reference to the tensor until ZeroMQ has written its bytes.
    // libzmq calls the free function on its I/O thread, ordered after this one by its lock-free
    // pipes, which ThreadSanitizer cannot see: the release/acquire pair tells it.
    auto* keep = new at::Tensor(owned[i]);
    zmq::message_t frame(keep->data_ptr(), byte_size(*keep),
                         [](void*, void* hint) {
                           sanitizer::acquire(hint);
                           delete static_cast<at::Tensor*>(hint);
                         },
                         keep);
    sanitizer::release(keep);  // after this thread's last use of *keep
    (void)socket.send(frame, i + 1 < owned.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  return true;
}

namespace {

// A placeholder (meta device) has no bytes to send: refused, naming it, before anything is staged.
absl::Status refuse_placeholders(const Tensors& tensors) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && tensors[i].device().is_meta()) {
      return absl::InvalidArgumentError(fmt::format("tensor {} is a placeholder without bytes (meta device)", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<EncodedMessage> encode_for_socket(wire::Header header, const Tensors& tensors, std::uint64_t* bytes_copied,
                                                const ShmStager* stager) {
  if (auto status = refuse_placeholders(tensors); !status.ok()) return status;
  return encode_message(std::move(header), tensors, bytes_copied, stager);
}

absl::StatusOr<bool> send_message(zmq::socket_t& socket, wire::Header header, const Tensors& tensors,
                                  zmq::send_flags flags, std::uint64_t* bytes_copied, const ShmStager* stager) {
  auto encoded = encode_for_socket(std::move(header), tensors, bytes_copied, stager);
  if (!encoded.ok()) return encoded.status();
  return send_encoded(socket, *encoded, flags);
}

absl::StatusOr<bool> send_references(zmq::socket_t& socket, wire::Header header, const Tensors& described,
                                     const std::vector<std::string>& frames, zmq::send_flags flags) {
  if (frames.size() != described.size()) {
    return absl::InvalidArgumentError(
        fmt::format("{} reference frames for {} tensors", frames.size(), described.size()));
  }
  header.flags |= wire::kFlagParked;
  // Placeholders (meta device) describe themselves; only send_message() must refuse them.
  auto encoded = encode_message(std::move(header), described, nullptr, nullptr);
  if (!encoded.ok()) return encoded.status();
  encoded->tensors.clear();  // the references stand for them
  encoded->handles = frames;
  return send_encoded(socket, *encoded, flags);
}

absl::Status send_packet(PacketLink& link, wire::Header header, const Tensors& tensors, std::uint64_t* bytes_copied,
                         const ShmStager* stager, const ShmUnstager* unstage, bool wait) {
  if (stager == nullptr && !tensors.empty()) {
    return absl::InvalidArgumentError("the data link carries handles, not tensor bytes: a stager is needed");
  }
  if (auto status = refuse_placeholders(tensors); !status.ok()) return status;
  auto encoded = encode_message(std::move(header), tensors, bytes_copied, stager, unstage);
  if (!encoded.ok()) return encoded.status();
  std::vector<std::string_view> frames{encoded->header};
  for (const auto& h : encoded->handles) frames.emplace_back(h);
  // The pools the handles name (host slots, CUDA records): the link carries each one's descriptor
  // with the first packet that names it.
  std::vector<std::uint64_t> pools;
  for (const auto& h : encoded->staged) {
    if (std::find(pools.begin(), pools.end(), h.pool_id) == pools.end()) pools.push_back(h.pool_id);
  }
  absl::Status sent = link.send(frames, wait, pools, [](std::uint64_t id) {
    ShmPoolFd pool = shm_pool_fd(id);
    return LinkFd{id, pool.fd, std::move(pool.keep), pool.retired};
  });
  if (!sent.ok() && unstage != nullptr) {
    for (const auto& staged : encoded->staged) (*unstage)(staged);  // the consumer never saw them
  }
  return sent;
}

absl::StatusOr<DecodedMessage> decode_message(std::vector<zmq::message_t>&& frames, const ShmResolver* resolver,
                                              const ParkedResolver* parked) {
  if (frames.empty()) return absl::InvalidArgumentError("empty message");
  DecodedMessage out;
  auto header = wire::decode_header(frames[0].data(), frames[0].size());
  if (!header.ok()) return header.status();
  out.header = *std::move(header);
  const bool handles = (out.header.flags & wire::kFlagShmHandles) != 0;
  // A message refused part-way gives back the handles from frame `first` on, which never became
  // tensors (those that did go back as their tensors die): else the producer holds their slots
  // until the link drops. A stale or forged one is only counted there.
  auto refuse = [&](std::size_t first, absl::Status status) {
    if (handles && resolver != nullptr && resolver->release) {
      for (std::size_t j = first; j < frames.size(); ++j) {
        if (auto h = wire::decode_shm_handle(frames[j].data(), frames[j].size()); h.ok()) resolver->release(*h);
      }
    }
    return status;
  };
  std::vector<std::size_t> sizes;
  for (std::size_t i = 1; i < frames.size(); ++i) sizes.push_back(frames[i].size());
  if (auto status = wire::check_frames(out.header, sizes); !status.ok()) return refuse(1, status);
  if (handles && resolver == nullptr) {
    return absl::InvalidArgumentError("shared-memory handles on a channel without shared memory");
  }
  const bool references = (out.header.flags & wire::kFlagParked) != 0;
  if (references && parked == nullptr) {
    return absl::InvalidArgumentError("parked-tensor references where none are expected");
  }
  for (std::size_t i = 0; i < out.header.tensors.size(); ++i) {
    const auto& desc = out.header.tensors[i];
    auto type = from_wire_dtype(desc.dtype);
    if (!type.ok()) return refuse(i + 1, type.status());
    if (handles) {
      auto handle = wire::decode_shm_handle(frames[i + 1].data(), frames[i + 1].size());
      if (!handle.ok()) {
        return refuse(i + 2, absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, std::string(handle.status().message()))));
      }
      auto tensor = resolver->resolve(desc, *handle, *type);
      if (!tensor.ok()) {
        return refuse(i + 1, absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, std::string(tensor.status().message()))));
      }
      out.tensors.push_back(*std::move(tensor));
      continue;
    }
    if (references) {
      auto id = wire::decode_parked_ids(frames[i + 1].data(), frames[i + 1].size());
      if (!id.ok()) return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, std::string(id.status().message())));
      auto tensor = (*parked)(desc, id->front(), *type);
      if (!tensor.ok()) return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, std::string(tensor.status().message())));
      out.tensors.push_back(*std::move(tensor));
      continue;
    }
    // Shared with the tensor's deleter: whichever lets go last frees it, whatever throws in between.
    auto frame = std::make_shared<zmq::message_t>(std::move(frames[i + 1]));
    const auto options = at::TensorOptions().dtype(*type);
    const auto element = wire::element_size(desc.dtype);
    void* data = frame->data();
    // The header was checked (sizes within i64, bytes matching the layout), so libtorch should take
    // it; should it still refuse (or memory run out), the message is refused, never thrown out of.
    try {
      if (desc.byte_count == 0 || reinterpret_cast<std::uintptr_t>(data) % element != 0) {
        // Empty or misaligned for its dtype: copy into an aligned tensor.
        at::Tensor t = at::empty_strided(desc.shape, desc.strides, options);
        if (desc.byte_count > 0) std::memcpy(t.data_ptr(), data, desc.byte_count);
        out.bytes_copied += desc.byte_count;
        out.tensors.push_back(std::move(t));
        continue;
      }
      out.tensors.push_back(at::from_blob(
          data, desc.shape, desc.strides, [frame](void*) mutable { frame.reset(); }, options));
    } catch (const c10::Error& e) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: {}", i, e.what()));
    }
  }
  return out;
}

}  // namespace blockflow::detail

namespace blockflow::detail {

ShmStager make_stager(ShmProducer& producer, StageWait wait) {
  return [&producer, wait](const at::Tensor& contiguous) -> absl::StatusOr<wire::ShmHandle> {
    if (!contiguous.device().is_cpu()) {
      return absl::InvalidArgumentError(fmt::format(
          "a tensor on {} cannot cross a zero-copy channel: CPU tensors cross in shared memory{}",
          contiguous.device().str(), contiguous.is_cuda() ? ", CUDA tensors over channel 'cuda'" : ""));
    }
    const std::size_t bytes = byte_size(contiguous);
    if (auto shared = producer.share(contiguous.data_ptr(), bytes)) return *shared;
    return producer.stage(contiguous.data_ptr(), bytes, wait.deadline());
  };
}

absl::StatusOr<std::size_t> contiguous_bytes(at::IntArrayRef sizes, at::ScalarType dtype) {
  if (dtype == at::ScalarType::Undefined) return absl::InvalidArgumentError("a tensor needs a dtype");
  std::size_t bytes = c10::elementSize(dtype);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return absl::InvalidArgumentError(fmt::format("size {} of dimension {} is negative", sizes[i], i));
    if (__builtin_mul_overflow(bytes, static_cast<std::size_t>(sizes[i]), &bytes)) {
      return absl::InvalidArgumentError(fmt::format("a tensor of sizes {} overflows 64 bits", fmt::join(sizes, "x")));
    }
  }
  return bytes;
}

absl::StatusOr<at::Tensor> checked_empty(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  if (auto bytes = contiguous_bytes(sizes, dtype); !bytes.ok()) return bytes.status();
  try {
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(e.what());
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(e.what());
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(e.what());  // no such device in this build, say
  }
}

ShmAllocator make_shm_allocator(ShmProducer& producer, absl::Duration wait) {
  return [&producer, wait](at::IntArrayRef sizes, at::ScalarType dtype) -> absl::StatusOr<at::Tensor> {
    auto bytes = contiguous_bytes(sizes, dtype);
    if (!bytes.ok()) return bytes.status();
    auto lease = producer.lease(*bytes, absl::Now() + wait);
    if (!lease.ok()) return lease.status();
    try {
      return at::from_blob(
          lease->data, sizes, [keep = lease->keep, drop = lease->drop](void*) { drop(); },
          at::TensorOptions().dtype(dtype));
    } catch (const std::exception& e) {
      lease->drop();  // the tensor that would have given the slot back was never made
      return absl::InternalError(e.what());
    }
  };
}

ShmResolver make_resolver(ShmConsumer& consumer, std::function<void(const wire::ShmHandle&)> release) {
  ShmResolver out;
  out.release = release;
  out.resolve = [&consumer, release = std::move(release)](const wire::TensorDesc& desc, const wire::ShmHandle& handle,
                                                          at::ScalarType type) -> absl::StatusOr<at::Tensor> {
    if (handle.memory != wire::kHostMemory) return absl::InvalidArgumentError("shm handle: not host memory");
    auto view = consumer.resolve(handle, desc.byte_count);
    if (!view.ok()) return view.status();
    if (reinterpret_cast<std::uintptr_t>(view->data) % wire::element_size(desc.dtype) != 0) {
      return absl::InvalidArgumentError(fmt::format("shm handle: offset {} is misaligned for {}", handle.offset,
                                                    wire::to_string(desc.dtype)));
    }
    return at::from_blob(
        view->data, desc.shape, desc.strides,
        [keep = view->keep, handle, release](void*) { release(handle); }, at::TensorOptions().dtype(type));
  };
  return out;
}

}  // namespace blockflow::detail
