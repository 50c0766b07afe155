#pragma once

// Which devices a worker of multi_worker_mirrored_strategy takes when its options name none
// (docs/multi_worker.md, "A worker's devices"): as mirrored_strategy() and TF's
// MultiWorkerMirroredStrategy, GPUs when the worker has some of its own, else the CPU;
// CONSORT_DEVICES_PER_WORKER (tools/consort-launch --devices-per-worker) says how many. A pure
// function of what the process sees, so that every branch is tested without a GPU.

#include <consort/error.hpp>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace consort::detail {

/// Where a worker is among the workers of its host, and whether the GPUs it sees are its own.
struct worker_placement {
  /// This worker's position among the workers of its host, and their number (a launcher's local
  /// rank and size; TF_CONFIG: the tasks at this task's host).
  int local_index = 0;
  int local_workers = 1;
  /// The launcher gave this worker its own GPUs (tools/consort-launch's CUDA_VISIBLE_DEVICES
  /// slice, CONSORT_OWN_GPUS=1): every GPU it sees is its own, whatever the other workers see.
  bool own_gpus = false;
};

/// The devices chosen, and a line to log when the choice is not the obvious one ("" when none).
struct device_choice {
  std::vector<std::string> devices;
  std::string note;
};

/// The default devices of a worker that sees `visible_gpus` GPUs, given
/// CONSORT_DEVICES_PER_WORKER's value `per_worker` (nullptr or empty: unset) and its placement:
/// - its GPUs are its own (`own_gpus`, or it is its host's only worker): the first `per_worker`
///   of them ("GPU:0", ...), all when unset; more than it sees is an error;
/// - it shares the host's GPUs with `local_workers` workers (torchrun, mpirun: every process sees
///   every GPU of the node): its slice of them by local index, `per_worker` each (unset: an equal
///   share), as torch's processes take the GPU of their LOCAL_RANK; when there are too few for a
///   slice each, CPU replicas, with a note (two workers' NCCL ranks cannot share one GPU);
/// - no GPU: `per_worker` CPU replicas ("CPU:0", ...), one when unset.
/// Errors: invalid_argument (a `per_worker` that is not a count in 1..1024, or more GPUs than a
/// worker with its own sees).
inline device_choice default_worker_devices(int visible_gpus, const char* per_worker,
                                            const worker_placement& where) {
  long wanted = 0;
  if (per_worker && *per_worker) {
    char* end = nullptr;
    wanted = std::strtol(per_worker, &end, 10);
    if (end == per_worker || *end != '\0' || wanted < 1 || wanted > 1024)
      throw_error(errc::invalid_argument,
                  "CONSORT_DEVICES_PER_WORKER is \"" + std::string{per_worker} +
                      "\"; expected the number of replicas of each worker, from 1 to 1024");
  }
  auto range = [](const char* kind, long first, long count) {
    std::vector<std::string> out;
    for (long i = first; i < first + count; ++i)
      out.push_back(std::string{kind} + ":" + std::to_string(i));
    return out;
  };
  const long cpus = wanted > 0 ? wanted : 1;
  if (visible_gpus <= 0)
    return {range("CPU", 0, cpus), ""};
  const long sharing = where.own_gpus ? 1 : std::max(1, where.local_workers);
  if (sharing == 1) {
    if (wanted > visible_gpus)
      throw_error(errc::invalid_argument,
                  "CONSORT_DEVICES_PER_WORKER asks for " + std::to_string(wanted) +
                      " replicas and this worker sees " + std::to_string(visible_gpus) +
                      " GPU(s); expected at most that many (one replica per GPU), or CPU "
                      "replicas: name them in multi_worker_options::devices, or hide the GPUs "
                      "with CUDA_VISIBLE_DEVICES=\"\"");
    return {range("GPU", 0, wanted > 0 ? wanted : visible_gpus), ""};
  }
  const long each = wanted > 0 ? wanted : visible_gpus / sharing;
  if (each >= 1 && each * sharing <= visible_gpus)
    return {range("GPU", where.local_index * each, each), ""};
  return {range("CPU", 0, cpus),
          std::to_string(sharing) + " workers on this host share its " +
              std::to_string(visible_gpus) + " GPU(s), too few for " +
              (wanted > 0 ? std::to_string(wanted) : std::string{"one"}) +
              " each: CPU replicas (give each worker its own GPUs, or name the devices in "
              "multi_worker_options::devices)"};
}

} // namespace consort::detail
