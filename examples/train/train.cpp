// consort-train: data-parallel training of an MLP classifier (16 -> 2 x 512 -> 4 by default,
// float32 GEMMs), run by replica actors on every worker. The same binary runs as 1 replica, N CPU
// replicas in one process, or N workers x K replicas (tools/consort-launch, TF_CONFIG, srun,
// mpirun); with the same seed and global batch the weights agree with a single-replica run to
// float32 rounding, which `--verify` checks over the first steps in the same process.
//
//   ./build/examples/train/consort-train                   # every GPU, else 1 CPU replica per core
//   ./build/examples/train/consort-train --devices GPU:0   # one GPU (verified on one CPU)
//   tools/consort-launch -n 2 -- ./build/examples/train/consort-train --hidden 1024 --layers 3
//   ./build/examples/train/consort-train --checkpoint-dir /tmp/ckpt   # again: resumes
//   ./build/examples/train/consort-train --data digits.csv.gz --steps 300   # real data (below)
//
// Each step: distribute_dataset hands each replica its slice of the global batch; each replica
// computes the summed loss and the gradients of its slice; the gradients are all-reduced (SUM) in
// fused buckets, each started as soon as the backward pass has produced it, and divided by the
// global batch, so partial batches weigh correctly. docs/train.md explains the options.
//
// With --checkpoint-dir the chief saves a checkpoint every --checkpoint-every steps, at the end,
// and when SIGTERM or SIGINT asks the job to stop (every worker stops after the same step; the
// exit status is then 128 + the signal's number). Started again with the same command, every
// worker resumes from the newest good checkpoint. The last line, `weights sha256: HEX`, names the
// final parameters, so that an interrupted and resumed run can be compared with one that was not.
//
// With --data FILE the demo learns a CSV file (optionally gzip'd) of numeric features and an
// integer label (csv_data.hpp has the format), standardized by the training rows' statistics;
// --test-fraction (0.2 with --data, 0 for the spiral) holds out rows chosen by --seed, and the
// chief evaluates the final weights on them (`held-out:` line). Every worker reads the file.

#include "common/cli.hpp"
#include "csv_data.hpp"
#include "trainer.hpp"

#include <consort/consort.hpp>

#include <openssl/evp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace consort;
using steady = std::chrono::steady_clock;

namespace {

struct options : train::train_options {
  int replicas = 0;    // 0: CONSORT_DEVICES_PER_WORKER, else one per core (2..8)
  std::string devices; // --devices: a comma-separated list instead of --replicas
  bool verify = true;
  double tolerance = -1;     // --tolerance; -1: train::verify_tolerance
  int64_t verify_steps = 10; // 1 with --data unless given (docs/train.md, "Real data")
  bool verify_steps_given = false;
  std::string plot;
  std::string trace;
  std::string checkpoint_dir;
  int64_t checkpoint_every_steps = 100;
  int elastic = 0;           // --elastic MIN: 0, not elastic
  int64_t commit_every = 10; // --commit-every: steps between in-memory commits (elastic)
  // -- real data (docs/train.md, "Real data") --
  std::string data;          // --data FILE; empty: the synthetic spiral
  std::string label_column;  // --label-column NAME|NUMBER; empty: the last column
  double test_fraction = -1; // -1: 0.2 with --data, 0 without
  int max_classes = 1000;
  bool examples_given = false;
  bool data_options_given = false; // --label-column or --max-classes
  /// The SHA-256 of the training rows when they are not the spiral's default (--data or
  /// --test-fraction): a checkpoint of other training rows is refused.
  std::string data_identity;
  /// --data: the features' standardization, saved in checkpoints beside the parameters
  /// (`input_mean`, `input_scale`) so that a server feeds the model what it was trained on.
  std::optional<train::feature_scaling> scaling;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "consort-train: " << problem << "\n(consort-train --help lists the options)\n";
  std::exit(2);
}

/// A byte count with an optional K, M or G (binary) suffix: 65536, 64K, 1M.
size_t byte_count(const std::string& name, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string suffix = end;
  double scale = suffix.empty()  ? 1
                 : suffix == "K" ? 1 << 10
                 : suffix == "M" ? 1 << 20
                 : suffix == "G" ? 1 << 30
                                 : -1;
  if (end == text.c_str() || scale < 0 || !(v >= 0))
    usage(name + " needs a byte count such as 65536, 64K or 1M; got \"" + text + "\"");
  return static_cast<size_t>(v * scale);
}

options parse(int argc, char** argv) {
  options o;
  cli::parser cmd("consort-train",
                  "Trains an MLP data-parallel on CPU replicas or GPUs (docs/train.md), on a "
                  "synthetic spiral or a CSV file, and checks the weights against one replica.");
  cmd.value("replicas", o.replicas,
            "CPU replicas (0: CONSORT_DEVICES_PER_WORKER, else one a core)");
  cmd.value("devices", o.devices, "the replicas' devices, e.g. CPU:0,CPU:1 or GPU:0,GPU:1");
  cmd.value("steps", o.steps, "training steps");
  cmd.value("global-batch", o.global_batch, "rows per step over every replica");
  cmd.value("lr", o.learning_rate, "learning rate");
  cmd.value("seed", o.seed, "seed of the weights, the spiral and the held-out split");
  auto* examples = cmd.value("examples", o.examples, "rows of the synthetic spiral");
  cmd.value("data", o.data, "a CSV file (optionally gzip'd) to learn instead of the spiral");
  auto* label = cmd.value("label-column", o.label_column,
                          "the label's header name or column number (1 is the first; default: the "
                          "last)");
  cmd.value("test-fraction", o.test_fraction,
            "rows held out, chosen by --seed (default 0.2 with --data, 0 without)");
  auto* classes =
      cmd.value("max-classes", o.max_classes, "the most classes a --data file may have");
  cmd.value("hidden", o.hidden, "units per hidden layer");
  cmd.value("layers", o.layers, "hidden layers");
  cmd.value("target-loss", o.target_loss, "stop once the loss is below it (0: never)");
  cmd.value("tolerance", o.tolerance, "--verify's limit (-1: the layout's default)");
  auto* verify_steps =
      cmd.value("verify-steps", o.verify_steps, "steps before --verify compares the weights");
  cmd.flag_pair("overlap", o.overlap, "all-reduce each bucket while the backward pass goes on");
  cmd.flag_pair("verify", o.verify, "compare the weights with one replica's after --verify-steps");
  std::string bucket_text;
  auto* bucket =
      cmd.value("bucket-bytes", bucket_text, "bytes per fused all-reduce (65536, 64K, 1M)");
  cmd.value("checkpoint-dir", o.checkpoint_dir, "save checkpoints here, and resume from them");
  cmd.value("checkpoint-every", o.checkpoint_every_steps, "steps between checkpoints");
  cmd.value("elastic", o.elastic,
            "go on when workers are lost or join, while at least this many remain (0: a lost "
            "worker ends the run)");
  cmd.value("commit-every", o.commit_every,
            "with --elastic: steps between in-memory commits, what a change rolls back to");
  cmd.value("plot", o.plot, "write the loss curve as SVG");
  cmd.value("trace", o.trace, "write a Chrome/Perfetto trace");
  cmd.parse(argc, argv);
  o.examples_given = examples->count() > 0;
  o.data_options_given = label->count() > 0 || classes->count() > 0;
  o.verify_steps_given = verify_steps->count() > 0;
  if (bucket->count() > 0)
    o.bucket_bytes = byte_count("--bucket-bytes", bucket_text);
  if (o.data.empty() && cmd.app().count("--data") > 0)
    usage("--data needs a CSV file (optionally gzip'd)");
  if (o.label_column.empty() && label->count() > 0)
    usage("--label-column needs a header name or a column number (1 is the first)");
  if (o.checkpoint_dir.empty() && cmd.app().count("--checkpoint-dir") > 0)
    usage("--checkpoint-dir needs a directory");
  if (o.test_fraction != -1 && !(o.test_fraction >= 0 && o.test_fraction < 1))
    usage("--test-fraction must be at least 0 and below 1; got " + std::to_string(o.test_fraction));
  if (o.tolerance != -1 && !(o.tolerance >= 0))
    usage("--tolerance must be 0 or more (or -1: the layout's default)");
  if (o.target_loss < 0)
    usage("--target-loss must be 0 or more");
  if (o.replicas < 0)
    usage("--replicas must be 0 or more (0: CONSORT_DEVICES_PER_WORKER, else one a core)");
  if (o.global_batch < 1 || o.hidden < 1 || o.examples < 1 || o.layers < 1 || o.steps < 1)
    usage("--steps, --global-batch, --hidden, --layers and --examples must be at least 1");
  if (!(o.learning_rate > 0))
    usage("--lr must be greater than 0");
  if (!o.devices.empty() && o.replicas != 0)
    usage("--devices and --replicas both say which replicas to run; give one of them");
  if (o.verify_steps < 1)
    usage("--verify-steps must be at least 1");
  if (o.checkpoint_every_steps < 1)
    usage("--checkpoint-every must be at least 1");
  if (o.elastic < 0)
    usage("--elastic must be 0 (not elastic) or the least number of workers to go on with");
  if (o.commit_every < 1)
    usage("--commit-every must be at least 1");
  if (!o.data.empty() && o.examples_given)
    usage("--examples sizes the synthetic spiral; --data trains on every row of its file");
  if (o.data.empty() && o.data_options_given)
    usage("--label-column and --max-classes describe a --data file; give --data FILE");
  if (o.max_classes < 2)
    usage("--max-classes must be at least 2");
  if (o.test_fraction < 0)
    o.test_fraction = o.data.empty() ? 0 : 0.2;
  // Real data checks the first step: no layout can flip a ReLU there (every one starts from the
  // same weights, and each row's forward pass has the same bits), while later steps may, and a
  // flip moves single weights by far more than reordered sums do (digits at --lr 0.1: 4e-3 after
  // 5 steps of 2 replicas).
  if (!o.data.empty() && !o.verify_steps_given)
    o.verify_steps = 1;
  if (o.verify)
    o.snapshot_step = std::min(o.verify_steps, o.steps);
  return o;
}

bool is_terminal() {
  return isatty(STDOUT_FILENO) != 0;
}

/// The chief's progress: a live bar on a terminal, a log line every 50 steps otherwise.
train::progress_fn progress_printer(int64_t steps) {
  return [steps](int64_t step, double loss, double accuracy, double rate) {
    if (is_terminal()) {
      int width = 30;
      int done = static_cast<int>(width * step / steps);
      std::printf("\r[%s%s] step %lld/%lld  loss %.4f  acc %.3f  %.0f examples/s ",
                  std::string(static_cast<size_t>(done), '#').c_str(),
                  std::string(static_cast<size_t>(width - done), '.').c_str(),
                  static_cast<long long>(step), static_cast<long long>(steps), loss, accuracy,
                  rate);
      if (step == steps)
        std::printf("\n");
    } else if (step % 50 == 0 || step == steps || step == 1) {
      std::printf("step %4lld/%lld  loss %.4f  accuracy %.3f  %.0f examples/s\n",
                  static_cast<long long>(step), static_cast<long long>(steps), loss, accuracy,
                  rate);
    }
    std::fflush(stdout);
  };
}

/// The replicas of `--devices`, checked: CPU replicas, or GPUs this process sees, not both (the
/// model keeps its parameters on the host for CPU replicas and on each GPU for GPU replicas).
/// Empty for an empty list.
std::vector<std::string> devices_of(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  size_t gpus = 0;
  while (start < list.size()) {
    auto comma = list.find(',', start);
    auto name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    device_spec spec;
    try {
      spec = parse_device(name);
    } catch (const error& e) {
      usage("--devices: " + std::string{e.what()});
    }
    gpus += spec.kind == device_kind::gpu ? 1 : 0;
    out.push_back(spec.to_string());
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  if (!list.empty() && out.empty())
    usage("--devices needs a list such as CPU:0,CPU:1 or GPU:0,GPU:1; got \"" + list + "\"");
  if (gpus != 0 && gpus != out.size())
    usage("--devices: give CPU replicas or GPUs, not both; got \"" + list + "\"");
  for (const auto& name : out)
    if (auto spec = parse_device(name); spec.kind == device_kind::gpu && spec.index >= num_gpus())
      usage("--devices: " + name + " is not available: this process sees " +
            std::to_string(num_gpus()) + " GPU(s)" +
            (num_gpus() == 0 ? " (" + gpus_unavailable_reason() + ")" : std::string{}));
  return out;
}

/// The replicas when neither --devices nor --replicas names them, as MirroredStrategy() picks
/// them: every visible GPU (or the first CONSORT_DEVICES_PER_WORKER of them, under the launcher's
/// --devices-per-worker), else CONSORT_DEVICES_PER_WORKER CPU replicas, else one per core (2..8).
std::vector<std::string> default_devices() {
  const char* env = std::getenv("CONSORT_DEVICES_PER_WORKER");
  int wanted = 0;
  if (env && *env) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || v < 1 || v > 4096)
      usage("CONSORT_DEVICES_PER_WORKER must be a count >= 1; got \"" + std::string{env} + "\"");
    wanted = static_cast<int>(v);
  }
  std::vector<std::string> out;
  if (const int gpus = num_gpus(); gpus > 0) {
    if (wanted > gpus)
      usage("CONSORT_DEVICES_PER_WORKER asks for " + std::to_string(wanted) +
            " replicas and this process sees " + std::to_string(gpus) +
            " GPU(s); give --devices CPU:0,... for CPU replicas");
    for (int i = 0; i < (wanted > 0 ? wanted : gpus); ++i)
      out.push_back("GPU:" + std::to_string(i));
    return out;
  }
  // One CPU replica per core (at least 2, so the demo is distributed, at most 8). Said aloud, so
  // that a run that should have found GPUs shows why it did not (and the GPU test's skip can tell
  // "no GPU here" from "GPUs here but not taken").
  std::printf("no GPU visible (%s): CPU replicas\n", gpus_unavailable_reason().c_str());
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  for (int i = 0; i < (wanted > 0 ? wanted : std::clamp(cores, 2, 8)); ++i)
    out.push_back("CPU:" + std::to_string(i));
  return out;
}

// -- checkpoints -------------------------------------------------------------------------------

/// The signal that asked the job to stop (SIGTERM, SIGINT), 0 while none has. The handler only
/// stores it; the training loop reads it at the next step (train_options::stop_requested).
std::atomic<int> stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "stored from a signal handler");

extern "C" void on_stop_signal(int signo) {
  stop_signal.store(signo);
}

/// SIGTERM and SIGINT ask for a checkpoint and a stop at the next step boundary, as TF's
/// PreemptionCheckpointHandler does. A second one changes nothing: launchers and schedulers often
/// deliver one stop twice (to the process and to its group), and the checkpoint must not be cut
/// short by it; SIGKILL ends the process at once.
void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

/// The options that decide the trained bytes besides the layout, as saved with each checkpoint:
/// a checkpoint of other options cannot continue this run.
std::map<std::string, std::string> run_identity(const options& o) {
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.17g", o.learning_rate);
  std::map<std::string, std::string> identity{{"global_batch", std::to_string(o.global_batch)},
                                              {"learning_rate", lr},
                                              {"seed", std::to_string(o.seed)},
                                              {"examples", std::to_string(o.examples)},
                                              {"hidden", std::to_string(o.hidden)},
                                              {"layers", std::to_string(o.layers)}};
  if (!o.data_identity.empty())
    identity["training_rows_sha256"] = o.data_identity;
  return identity;
}

/// A checkpoint this run cannot continue: main says why and exits with status 2, after the
/// strategy has shut down (usage() would exit under its feet).
struct refused_checkpoint : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Refuses a checkpoint whose run had other options, naming the first that differs.
void check_same_run(const options& o, const loaded_checkpoint& last) {
  for (const auto& [key, value] : run_identity(o)) {
    auto it = last.data.metadata.user.find(key);
    const std::string theirs = it == last.data.metadata.user.end() ? "(none)" : it->second;
    if (theirs != value)
      throw refused_checkpoint("--checkpoint-dir: " + last.path + " was written by a run with " +
                               key + " " + theirs + ", this one has " + value +
                               "; give the same options to resume it, or another --checkpoint-dir");
  }
  if (last.data.metadata.step > o.steps)
    throw refused_checkpoint("--checkpoint-dir: " + last.path + " is at step " +
                             std::to_string(last.data.metadata.step) + ", past --steps " +
                             std::to_string(o.steps));
}

/// The SHA-256 of the parameters' bytes, leaf after leaf in flatten order (dict keys sorted), in
/// hex.
std::string weights_sha256(const nest& params) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("SHA-256 is not available from OpenSSL");
  for (const auto& leaf : flatten(params)) {
    const tensor host = leaf.to("CPU:0");
    EVP_DigestUpdate(ctx.get(), host.raw_data(), host.num_bytes());
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &size);
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) {
    char byte[3];
    std::snprintf(byte, sizeof byte, "%02x", digest[i]);
    hex += byte;
  }
  return hex;
}

// -- data ------------------------------------------------------------------------------------

/// The rows the run trains on and those it holds out, and the chief's line about them.
struct loaded_data {
  train::data_split split;
  std::string description; // empty for the spiral without a split
};

/// The spiral (and its split, with --test-fraction), or the --data file, split by --seed and
/// standardized by the training rows. Sets `o.classes` (from every row, held-out ones included),
/// `o.examples` (the file's rows) and `o.data_identity`. Called before the strategy starts, so a
/// bad file ends the worker at once: exit status 2 and the reader's message.
loaded_data load_data(options& o) {
  loaded_data out;
  char fraction[64];
  std::snprintf(fraction, sizeof fraction, "--test-fraction %g, --seed %llu", o.test_fraction,
                static_cast<unsigned long long>(o.seed));
  try {
    if (o.data.empty()) {
      train::synthetic_options spiral;
      spiral.examples = o.examples;
      spiral.seed = o.seed;
      auto all = train::make_dataset(spiral);
      o.classes = spiral.classes;
      if (o.test_fraction == 0) {
        out.split.train = all;
        return out;
      }
      out.split = train::split_rows(all, o.test_fraction, o.seed);
      out.description = "synthetic spiral, " + std::to_string(o.examples) + " rows";
    } else {
      train::csv_options csv;
      csv.label_column = o.label_column;
      csv.max_classes = o.max_classes;
      auto file = train::read_csv(o.data, csv);
      o.classes = file.classes;
      o.examples = file.data.y.num_elements();
      out.split = train::split_rows(file.data, o.test_fraction, o.seed);
      o.scaling = train::standardize(out.split);
      out.description =
          o.data + (file.gzipped ? " (gzip)" : "") + ": " + std::to_string(o.examples) + " rows, " +
          std::to_string(file.data.x.shape()[1]) + " features, label column " +
          std::to_string(file.label_column) +
          (file.has_header ? " \"" + file.label_name + "\" (header row)" : " (no header row)") +
          ", " + std::to_string(file.classes) +
          " classes; features standardized by the "
          "training rows";
    }
  } catch (const train::data_error& e) {
    std::fprintf(stderr, "consort-train: --data %s\n", e.what());
    std::exit(2);
  } catch (const std::invalid_argument& e) {
    usage(e.what());
  }
  out.description += "; " + std::to_string(out.split.train.y.num_elements()) + " train, " +
                     std::to_string(out.split.test.y.num_elements()) + " held out (" + fraction +
                     ")";
  o.data_identity = weights_sha256(out.split.train.as_nest());
  return out;
}

/// With --checkpoint-dir: resumes `o` from the newest good checkpoint (every worker reads it),
/// arranges the saves (the chief writes) and the stop on SIGTERM/SIGINT.
void arrange_checkpoints(options& o, std::optional<checkpoint_manager>& manager,
                         const train::dataset_tensors& data,
                         const multi_worker_mirrored_strategy& strategy) {
  if (o.checkpoint_dir.empty())
    return;
  const bool chief = strategy.worker_rank() == 0;
  manager.emplace(o.checkpoint_dir);
  install_stop_handlers();
  o.stop_requested = [] {
    return stop_signal.load() != 0;
  };
  o.checkpoint_every = o.checkpoint_every_steps;
  if (auto last = manager->restore_latest()) {
    check_same_run(o, *last);
    train::mlp_shape shape{static_cast<int>(data.x.shape()[1]), o.hidden,
                           train::classes_of(o, data), o.layers};
    o.initial_params = restore_nest(train::init_params(shape, o.seed), last->data);
    o.start_step = last->data.metadata.step;
    if (chief)
      std::printf("resumed from checkpoint at step %lld (%s)\n",
                  static_cast<long long>(o.start_step), last->path.c_str());
  }
  if (!chief)
    return;
  checkpoint_metadata meta;
  meta.num_workers = strategy.num_workers();
  meta.num_replicas_in_sync = strategy.num_replicas_in_sync();
  meta.user = run_identity(o);
  // No generator draws after the initial parameters: the seed is the whole RNG state.
  meta.rng_state.assign(reinterpret_cast<const char*>(&o.seed), sizeof o.seed);
  o.on_checkpoint = [&manager, meta, scaling = o.scaling](int64_t step,
                                                          const nest& params) mutable {
    meta.step = step;
    meta.dataset_position = step; // batches consumed; step s reads batch s % batches
    auto tensors = named_leaves(params);
    if (scaling) {
      tensors.push_back({"input_mean", scaling->mean});
      tensors.push_back({"input_scale", scaling->scale});
    }
    auto path = manager->save(tensors, meta);
    std::printf("saved checkpoint at step %lld: %s\n", static_cast<long long>(step), path.c_str());
    std::fflush(stdout);
  };
}

/// Trains; with --elastic, goes on through changes of the group (docs/train.md, "Elastic
/// training"): every --commit-every steps each worker commits the step and the model's variables in
/// memory; a change fails the step in flight with membership_changed, the workers take part in
/// the group's next epoch (reform), every one takes the group's commit (sync), and training goes
/// on from there on the new group, its dataset split over the new replicas. A worker that joins
/// the running group takes the group's commit the same way. Each change prints one line on every
/// worker of the group, once the first step after it completed.
/// `snapshot_replicas`: the replicas in sync when --verify's snapshot was taken (a later change
/// may have changed them). `started_at`: the step this worker started from (a worker that
/// joined a running group: the
/// group's).
train::outcome train_through_changes(multi_worker_mirrored_strategy& strategy, const options& o,
                                     const train::dataset_tensors& data, train::tracer& trace,
                                     int64_t& started_at, int& snapshot_replicas) {
  started_at = o.start_step;
  snapshot_replicas = strategy.num_replicas_in_sync();
  auto progress = [&] {
    return strategy.worker_rank() == 0 ? progress_printer(o.steps) : train::progress_fn{};
  };
  if (o.elastic == 0)
    return train::train_on(strategy, o, data, trace, strategy.worker_rank(), progress());
  using steady = std::chrono::steady_clock;
  train::mlp_shape shape{static_cast<int>(data.x.shape()[1]), o.hidden, train::classes_of(o, data),
                         o.layers};
  // The model's variables first: the commits keep them (a worker that joins a running group
  // makes its own, which its first sync replaces with the group's).
  const auto model = train::model_on(
      strategy, shape,
      o.initial_params.is_dict() ? o.initial_params : train::init_params(shape, o.seed));
  elastic_state state{strategy};
  auto commit = [&state](int64_t step, const nest&) {
    state.commit(nest::dict({{"step", tensor::scalar<int64_t>(step)}}));
  };
  commit(o.start_step, nest{});
  // Worker 0's commit, everywhere (a worker that joined a running group takes the group's); a
  // change during a sync re-forms again.
  auto synced = [&] {
    for (;;) {
      try {
        return state.sync();
      } catch (const error& e) {
        if (e.code() != errc::membership_changed)
          throw;
        strategy.reform();
      }
    }
  };
  auto extra = synced();
  started_at = extra["step"].as_tensor().item<int64_t>();
  train::train_options run = o;
  run.commit_every = o.commit_every;
  run.on_commit = commit;
  std::string pending;
  steady::time_point lost_at;
  int64_t reached = extra["step"].as_tensor().item<int64_t>();
  // --verify's: the parameters after snapshot_step, in the segment that last got there.
  nest snapshot;
  run.on_step = [&](int64_t step, const nest& params) {
    reached = step;
    if (step == o.snapshot_step) {
      snapshot = params; // shared: the next update copies them first
      snapshot_replicas = strategy.num_replicas_in_sync();
    }
    if (pending.empty())
      return;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(steady::now() - lost_at);
    std::printf("%s; training resumed %lld ms after the loss\n", pending.c_str(),
                static_cast<long long>(ms.count()));
    std::fflush(stdout);
    pending.clear();
  };
  for (;;) {
    run.start_step = extra["step"].as_tensor().item<int64_t>();
    run.initial_params = model.params_on_host(); // the group's, as the sync left them
    try {
      auto result = train::train_on(strategy, run, data, trace, strategy.worker_rank(), progress());
      if (!result.snapshot.is_dict())
        result.snapshot = snapshot;
      return result;
    } catch (const error& e) {
      if (e.code() != errc::membership_changed)
        throw;
      lost_at = steady::now();
      auto change = strategy.reform();
      if (!pending.empty())
        std::printf("%s; changed again before a step completed\n", pending.c_str());
      pending = "membership: " + std::to_string(change.workers_before) + " -> " +
                std::to_string(change.workers) + " workers at step " + std::to_string(reached);
      extra = synced();
    }
  }
}

/// --trace: one trace of the whole job, written by the chief. Every worker's events travel to it
/// by two gathers (their lengths, then their bytes, one worker after another).
void write_job_trace(multi_worker_mirrored_strategy& strategy, const train::tracer& trace,
                     const std::string& path) {
  const int workers = strategy.num_workers();
  if (workers == 1)
    return trace.write(path);
  // On the chief's clock: the same host's clocks agree, other hosts' are moved by the offset the
  // membership heartbeats measured.
  const auto offset = strategy.chief_clock_offset();
  const auto text = trace.events_json(offset.known ? offset.offset_ns / 1000 : 0);
  const auto lengths =
      strategy.gather(tensor::from<int64_t>({static_cast<int64_t>(text.size())}, {1}), 0)
          .to_vector<int64_t>();
  const auto bytes =
      strategy.gather(tensor::from<uint8_t>(std::vector<uint8_t>(text.begin(), text.end()),
                                            {static_cast<int64_t>(text.size())}),
                      0);
  if (strategy.worker_rank() != 0)
    return;
  std::vector<std::string> events, names;
  const auto* data = reinterpret_cast<const char*>(bytes.data<uint8_t>());
  int64_t at = 0;
  for (int w = 0; w < workers; ++w) {
    events.emplace_back(data + at, static_cast<size_t>(lengths[static_cast<size_t>(w)]));
    at += lengths[static_cast<size_t>(w)];
    names.push_back("worker:" + std::to_string(w));
  }
  train::tracer::write_job(path, events, names);
}

} // namespace

int main(int argc, char** argv) {
  auto o = parse(argc, argv);
  try {
    // Before the strategy starts: a bad file ends every worker at once, with nothing to shut down.
    const auto loaded = load_data(o);
    const train::dataset_tensors& data = loaded.split.train;
    multi_worker_options mw;
    if (!o.devices.empty())
      mw.devices = devices_of(o.devices);
    else if (o.replicas > 0)
      for (int i = 0; i < o.replicas; ++i)
        mw.devices.push_back("CPU:" + std::to_string(i));
    else
      mw.devices = default_devices();
    mw.elastic_min_workers = o.elastic;
    multi_worker_mirrored_strategy strategy({}, mw);
    bool chief = strategy.worker_rank() == 0;
    int worker = strategy.worker_rank();
    std::string device_list;
    for (const auto& device : strategy.worker_devices())
      device_list += (device_list.empty() ? "" : ",") + device;
    if (chief)
      std::printf("consort-train: %d worker(s) x %zu replica(s) on %s = %d replicas in sync; MLP "
                  "%lld -> %d x %d -> %d, %lld examples, global batch %lld, "
                  "%lld steps, buckets of %zu bytes, %s\n",
                  strategy.num_workers(), strategy.num_local_replicas(), device_list.c_str(),
                  strategy.num_replicas_in_sync(), static_cast<long long>(data.x.shape()[1]),
                  o.layers, o.hidden, train::classes_of(o, data),
                  static_cast<long long>(data.y.num_elements()),
                  static_cast<long long>(o.global_batch), static_cast<long long>(o.steps),
                  o.bucket_bytes, o.overlap ? "overlap on" : "overlap off");
    if (chief && !loaded.description.empty())
      std::printf("data: %s\n", loaded.description.c_str());
    if (chief && parse_device(strategy.worker_devices()[0]).kind == device_kind::gpu)
      std::printf("GEMMs on the GPU: %s\n", train::gpu_gemm_backend().c_str());
    std::optional<checkpoint_manager> manager;
    arrange_checkpoints(o, manager, data, strategy);
    train::tracer trace(!o.trace.empty());
    int64_t started_at = 0;
    int snapshot_replicas = 0;
    auto result = train_through_changes(strategy, o, data, trace, started_at, snapshot_replicas);
    // An elastic group may have renumbered the workers (a chief's successor is the chief now).
    worker = strategy.worker_rank();
    chief = worker == 0;
    if (chief && result.curve.loss.empty())
      std::printf("trained: no step left after step %lld\n", static_cast<long long>(result.steps));
    else if (chief) {
      std::printf("trained: %lld steps, final loss %.4f, accuracy %.3f; %.0f examples/s, %.2f s "
                  "in collectives (summed over local replicas)\n",
                  static_cast<long long>(result.steps), result.curve.loss.back(),
                  result.curve.accuracy.back(), result.examples_per_s, result.collective_s);
      if (const auto& ends = result.curve.epoch_end; !ends.empty()) {
        const int64_t first = result.curve.epoch_first.back();
        std::printf("metrics (sync-on-read, every replica of every worker): steps %lld-%lld, "
                    "loss %.4f, accuracy %.3f\n",
                    static_cast<long long>(first), static_cast<long long>(ends.back()),
                    result.curve.epoch_loss.back(), result.curve.epoch_accuracy.back());
      }
      if (o.target_loss > 0) {
        if (result.reached_target)
          std::printf("target loss %.4f reached at step %lld after %.3f s\n", o.target_loss,
                      static_cast<long long>(result.steps), result.time_to_target_s);
        else
          std::printf("target loss %.4f not reached in %lld steps (%.3f s)\n", o.target_loss,
                      static_cast<long long>(result.steps), result.elapsed_s);
      }
    }
    // The held-out rows, on the chief only: one forward pass of the final weights on the host.
    if (chief && loaded.split.test.y.valid() && loaded.split.test.y.num_elements() > 0) {
      const auto held = train::evaluate(result.params, loaded.split.test);
      std::printf("held-out: %lld rows, loss %.4f, accuracy %.3f\n",
                  static_cast<long long>(held.rows), held.loss, held.accuracy);
    }
    std::fflush(stdout);
    if (!o.plot.empty() && chief) {
      train::write_plot(o.plot, result.curve);
      std::printf("wrote %s\n", o.plot.c_str());
    }
    if (trace.on()) {
      write_job_trace(strategy, trace, o.trace);
      if (chief)
        std::printf("wrote %s (open in https://ui.perfetto.dev)\n", o.trace.c_str());
    }
    int status = 0;
    // A run stopped by a signal has its grace period to use, not a reference run to train.
    if (o.verify && !result.stopped && started_at >= o.snapshot_step && started_at > 0) {
      // It joined a running group (--elastic) after the steps --verify compares: the workers
      // that trained them compared theirs.
      std::printf("verify (worker %d): joined the group at step %lld, after the %lld steps "
                  "--verify compares; nothing of its own to compare\n",
                  worker, static_cast<long long>(started_at),
                  static_cast<long long>(o.snapshot_step));
    } else if (o.verify && !result.stopped) {
      // The reference: one replica in this process, same seed and global batch, over the first
      // steps (all of them when the run stopped before the snapshot), on the device of the run's
      // first replica. Every example's forward pass then has the same bits as in the run, only
      // the order of the gradient sums differs, and every weight agrees to float32 rounding.
      const bool whole = result.snapshot.is_dict() == false;
      const nest& mine = whole ? result.params : result.snapshot;
      auto same = static_cast<train::train_options>(o);
      same.steps = whole ? result.steps : o.snapshot_step;
      same.target_loss = 0;
      same.snapshot_step = 0;
      // The reference starts from the seed and saves nothing.
      same.start_step = 0;
      same.initial_params = nest{};
      same.stop_requested = {};
      same.checkpoint_every = 0;
      same.on_checkpoint = {};
      const std::string first = strategy.worker_devices()[0];
      const bool on_gpus = parse_device(first).kind == device_kind::gpu;
      const double limit = o.tolerance >= 0 ? o.tolerance : train::verify_tolerance;
      one_device_strategy single(on_gpus ? first : "CPU:0");
      train::tracer off(false);
      auto reference = train::train_on(single, same, data, off, 0);
      auto worst = train::largest_difference(mine, reference.params);
      bool ok = worst.relative <= limit;
      std::printf("verify (worker %d): weights after %lld steps of %d %s replicas vs 1 %s "
                  "replica: max relative difference %.2e (limit %.0e): %s\n",
                  worker, static_cast<long long>(same.steps),
                  whole ? strategy.num_replicas_in_sync() : snapshot_replicas,
                  on_gpus ? "GPU" : "CPU", on_gpus ? "GPU" : "CPU", worst.relative, limit,
                  ok ? "OK" : "MISMATCH");
      if (!ok)
        std::printf("verify (worker %d): largest at parameter %zu element %zu: %.9g here, %.9g "
                    "in the reference\n",
                    worker, worst.tensor, worst.element, static_cast<double>(worst.a),
                    static_cast<double>(worst.b));
      if (on_gpus) {
        // The GPU kernels against the host model: one step on one GPU replica and on one CPU
        // replica. Their forward passes round differently, and a pre-activation within rounding
        // of zero lands on the other side of its ReLU, which moves single gradient elements by
        // up to 1e-3 relative and whole tensors by about 1e-4 normwise; training compounds it.
        // So this check takes one step and compares each tensor normwise (docs/train.md).
        auto one = static_cast<train::train_options>(same);
        one.steps = 1;
        auto gpu_step = train::train_on(single, one, data, off, 0);
        one_device_strategy host("CPU:0");
        auto host_step = train::train_on(host, one, data, off, 0);
        auto kernels = train::largest_difference(gpu_step.params, host_step.params);
        bool kernels_ok = kernels.normwise <= train::verify_tolerance_gpu;
        std::printf("verify (worker %d): weights after 1 step on %s vs 1 CPU replica: normwise "
                    "relative difference %.2e (limit %.0e): %s\n",
                    worker, first.c_str(), kernels.normwise, train::verify_tolerance_gpu,
                    kernels_ok ? "OK" : "MISMATCH");
        ok = ok && kernels_ok;
      }
      status = ok ? 0 : 1;
    }
    if (result.stopped) {
      const int signo = stop_signal.load();
      if (chief)
        std::printf("stopped by %s after step %lld; checkpoint saved\n",
                    signo == SIGINT ? "SIGINT" : "SIGTERM", static_cast<long long>(result.steps));
      status = status != 0 ? status : 128 + signo;
    }
    if (chief)
      std::printf("weights sha256: %s\n", weights_sha256(result.params).c_str());
    return status;
  } catch (const refused_checkpoint& e) {
    std::fprintf(stderr, "consort-train: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consort-train: %s\n", e.what());
    return 1;
  }
}
