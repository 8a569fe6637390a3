#include <blockflow/core/result.hpp>
#include <blockflow/core/detail/clock.hpp>

#include <stdexcept>

namespace blockflow {

using detail::ns_to_ms;

double HopTiming::wait_ms() const { return ns_to_ms(dequeued_ns - arrived_ns + entry_wait_ns); }
double HopTiming::load_ms() const { return ns_to_ms(load_end_ns - load_start_ns); }
double HopTiming::compute_ms() const { return ns_to_ms(compute_end_ns - compute_start_ns); }
double HopTiming::overhead_ms() const {
  return ns_to_ms((arrived_ns - input_ready_ns) + (compute_start_ns - dequeued_ns) - (load_end_ns - load_start_ns) +
                  (done_ns - compute_end_ns));
}

double RequestTrace::e2e_ms() const { return ns_to_ms(resolved_ns - submitted_ns); }

double RequestTrace::wait_ms() const {
  double sum = 0;
  for (const auto& hop : hops) sum += hop.wait_ms();
  return sum;
}

double RequestTrace::load_ms() const {
  double sum = 0;
  for (const auto& hop : hops) sum += hop.load_ms();
  return sum;
}

double RequestTrace::compute_ms() const {
  double sum = 0;
  for (const auto& hop : hops) sum += hop.compute_ms();
  return sum;
}

double RequestTrace::overhead_ms() const {
  double sum = 0;
  for (const auto& hop : hops) sum += hop.overhead_ms();
  return sum;
}

const Tensor& Result::output() const {
  if (!status.ok()) throw std::logic_error("Result::output() on a failed request: " + status.ToString());
  if (outputs.empty()) throw std::logic_error("Result::output(): the request produced no tensor");
  return outputs.front();
}

}  // namespace blockflow
