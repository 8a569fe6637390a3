#pragma once
// Internal: JSON conversions of the metrics types, both ways (MetricsSnapshot::to_json/from_json,
// worker heartbeats). Keys are the member names; docs/metrics.md lists them.
#include <blockflow/core/kpi.hpp>
#include <blockflow/core/metrics.hpp>

#include <nlohmann/json.hpp>

namespace blockflow {

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(CudaGraphStats, graphs, replays, eager_runs)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(LatencyStats, count, mean_ms, p50_ms, p90_ms, p99_ms, max_ms, sum_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ChannelStats, kind, sent, received, rejected, dropped, bytes_copied,
                                                depth, capacity, high_watermark, past_capacity)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ShmEdgeStats, handles, releases, leases, slots_in_use, slots_total,
                                                credit_waits, reclaims, stale_releases, bytes_staged, bytes_mapped,
                                                pools, pools_trimmed, pools_created, forwarded)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ProcessSample, rss_bytes, cpu_seconds, cpu_utilisation, threads,
                                                voluntary_context_switches, involuntary_context_switches)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(GpuSample, index, name, memory_used_bytes, memory_total_bytes,
                                                utilisation, sm_clock_mhz, temperature_c, power_w,
                                                process_memory_bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(TorchCudaMemory, device, allocated_bytes, reserved_bytes,
                                                peak_allocated_bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(KpiSample, time_s, process, gpus, gpu_status, torch_cuda,
                                                torch_cuda_status, energy_j)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(SiteStats, name, kind, pid, forked, restarts, lost, failed_requests, in_flight,
                                                malformed_frames, parked_outputs, direct_forwards, rss_idle_bytes, rss_bytes,
                                                computing_block, computing_s, data, shm_requests,
                                                shm_results, cuda_requests, cuda_results, kpi, blocks_resident_bytes, block_loads,
                                                block_evictions, block_bytes_loaded, block_load_s, block_swap_ins,
                                                swapped_bytes, memory_measure, unaccounted_bytes, cuda_graphs)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(BlockMetrics, name, kind, device, placement, workers,
                                                intra_op_threads, processed, failed, batches, batched_requests, layout_kept, handed_directly,
                                                computing_s, on_demand, resident, footprint_bytes, loads, evictions, last_use_s, cuda_graph, wait,
                                                compute, overhead,
                                                throughput_per_s, queue)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(PathMetrics, task, active, submitted, completed, failed, e2e, wait, compute,
                                                overhead, throughput_per_s, active_ms, waiting_at_entry, waited_at_entry)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(LaneMetrics, index, runs, tasks, inline_continuations, one_thread_runs, sleeps, threads, busy_s, utilisation)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(SiteMemory, site, budget_bytes, profiled_bytes, measured_bytes, policy,
                                                resident_bytes, loads, evictions, bytes_loaded, load_s, prefetches,
                                                swap_ins, swapped_bytes, measure, unaccounted_bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(UpdateStats, version, blocks_added, blocks_removed, sites_started,
                                                sites_stopped, load_ms, route_ms, drain_ms, total_ms,
                                                time_to_first_result_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ReplanStats, lost_sites, losses, applied, failed, last_ms, last_version, last_error)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(StartStats, process_to_start_ms, start_ms, time_to_first_result_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(MetricsSnapshot, uptime_s, in_flight, version, last_update, start, retired_blocks, auth_failures, sampling, sampling_period_s,
                                                host, blocks, paths, sites, lanes, lane_intra_op_threads, memory, replan)

}  // namespace blockflow
