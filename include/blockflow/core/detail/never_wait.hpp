#pragma once
// Internal: threads that must never wait for room in a block's full queue (policy block): a site's
// receiving thread as it hands a worker's result on (the room may depend on that very thread), a
// client endpoint's thread as it submits (it serves every client). A request such a thread hands to
// a full queue goes to the block's hand-over line instead, queued in order by a lane
// (SessionCore::queue_from_site(), docs/lanes.md "Bounded queues").
#include <utility>

namespace blockflow::detail {

/// True while this thread may not wait for room in a full queue.
extern thread_local bool delivering_for_site;

/// While it lives, this thread hands requests to full queues over instead of waiting.
class NeverWaitHere {
 public:
  NeverWaitHere() : outer_(std::exchange(delivering_for_site, true)) {}
  ~NeverWaitHere() { delivering_for_site = outer_; }
  NeverWaitHere(const NeverWaitHere&) = delete;
  NeverWaitHere& operator=(const NeverWaitHere&) = delete;

 private:
  bool outer_;
};

}  // namespace blockflow::detail
