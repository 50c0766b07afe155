#pragma once

/// Checkpoints: tensors saved to and restored from files, as `tf.train.Checkpoint` and
/// `tf.train.CheckpointManager` do, in safetensors' layout so that numpy and torch can read them
/// (docs/checkpoints.md describes the format).
///
/// The input is a list of named tensors, so that anything with names and tensors can be saved:
/// a nest (`named_leaves`), a model's parameters, a strategy's variables. Each file also carries
/// the training state that a resumed run needs (`checkpoint_metadata`).
///
/// Who writes: in a multi-worker job only the chief (worker rank 0) should call `save_checkpoint`
/// or `checkpoint_manager::save`, into a directory every worker can read; every worker reads. The
/// library does not check this: two writers of one path each write a whole file (the writes are
/// atomic), and the last rename wins.
///
///     consort::checkpoint_manager manager("/ckpt");
///     if (auto last = manager.restore_latest())
///       params = consort::restore_nest(params, last->data);  // checks names, dtypes, shapes
///     ...
///     consort::checkpoint_metadata meta;
///     meta.step = step;
///     if (strategy.worker_rank() == 0)
///       manager.save(consort::named_leaves(params), meta);

#include <consort/nest.hpp>
#include <consort/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace consort {

/// One tensor of a checkpoint and its name (the safetensors key).
struct named_tensor {
  std::string name;
  tensor value;
};

/// The training state saved with the tensors. Stored in the file's `__metadata__` as strings under
/// `consort.*` keys (the user's entries under `user.*`).
struct checkpoint_metadata {
  /// Steps completed when the checkpoint was taken.
  int64_t step = 0;
  /// How far the input has been read (for example batches consumed), as the caller counts it.
  int64_t dataset_position = 0;
  /// The random number generators' state, opaque bytes (stored as hex).
  std::string rng_state;
  /// The cluster the checkpoint was taken on: workers, and replicas in sync.
  int num_workers = 1;
  int num_replicas_in_sync = 1;
  /// Free-form entries of the caller.
  std::map<std::string, std::string> user;
};

/// A checkpoint as read from a file: every checksum has been verified.
struct checkpoint_data {
  /// The tensors in the file's order (by data offset), on the host.
  std::vector<named_tensor> tensors;
  checkpoint_metadata metadata;

  /// The tensor named `name`, or nullptr.
  const tensor* find(const std::string& name) const noexcept;
};

/// The leaves of `value` with names from their paths: dict keys and list indices joined by "/"
/// (`{"dense": [w, b]}` gives "dense/0" and "dense/1"); a lone tensor is named "value".
/// @throws error(invalid_argument) when two leaves get one name (a key containing "/").
std::vector<named_tensor> named_leaves(const nest& value);

/// Writes `tensors` and `metadata` to `path` atomically: to a temporary file in the same
/// directory, `fsync`ed, renamed over `path`, and the directory `fsync`ed. After a crash or a
/// failure the path holds the old file or the new one, never a part of either, and no temporary
/// file is left behind by a failure that returns. GPU tensors are copied to the host first.
///
/// Thread safety: may be called from several threads for different paths.
/// @throws error(invalid_argument) for an empty or duplicate name or the reserved "__metadata__";
///         error(io_error) when the system refuses (a full disk: ENOSPC; no directory; no
///         permission), naming the call, the path and the reason.
void save_checkpoint(const std::string& path, const std::vector<named_tensor>& tensors,
                     const checkpoint_metadata& metadata);

/// Reads the checkpoint at `path` and verifies it: the layout, every tensor's bytes against its
/// CRC32C checksum, the metadata.
/// @throws error(io_error) when the file cannot be opened or read; error(data_loss) when it is
///         truncated, torn or corrupted: the message names the file, the tensor where one is to
///         blame, and what was expected against what was found.
checkpoint_data load_checkpoint(const std::string& path);

/// `like` with every leaf replaced by the checkpoint's tensor of the same name (`named_leaves`),
/// each checked against the leaf it replaces. Tensors of the checkpoint that `like` does not name
/// are ignored. The results are on the host.
/// @throws error(structure_mismatch) when the checkpoint lacks a leaf's name;
///         error(dtype_mismatch) or error(shape_mismatch) when a tensor differs from its leaf.
///         Each message names the tensor, what was expected and what the checkpoint holds.
nest restore_nest(const nest& like, const checkpoint_data& data);

/// The same check for a list of named tensors: the checkpoint's tensors in the order of
/// `expected`, each with `expected`'s dtype and shape. Throws as `restore_nest`.
std::vector<named_tensor> restore_tensors(const std::vector<named_tensor>& expected,
                                          const checkpoint_data& data);

/// How a `checkpoint_manager` names and keeps its files.
struct checkpoint_manager_options {
  /// The newest checkpoints kept; older ones are deleted after each save. At least 1.
  size_t max_to_keep = 5;
  /// File names are `<prefix>-<step>.safetensors`.
  std::string prefix = "ckpt";
  /// Called with a line for each checkpoint that `restore_latest` skips (torn or corrupted), saying
  /// which and why; empty: the line goes to stderr.
  std::function<void(const std::string&)> on_warning;
};

/// The newest good checkpoint: where it is and what it holds.
struct loaded_checkpoint {
  std::string path;
  checkpoint_data data;
};

/// The checkpoints of one directory, as `tf.train.CheckpointManager`: saves
/// `<prefix>-<step>.safetensors` files, keeps the newest `max_to_keep`, and finds the newest good
/// one to resume from.
///
/// Thread safety: not thread-safe; one writer per directory (the chief), any number of readers.
class checkpoint_manager {
public:
  /// Manages `directory`, creating it (and its parents) when it does not exist.
  /// @throws error(invalid_argument) for max_to_keep 0 or a prefix that is empty or contains "/";
  ///         error(io_error) when the directory cannot be created.
  explicit checkpoint_manager(std::string directory, checkpoint_manager_options options = {});

  /// Saves a checkpoint at `metadata.step` (replacing one of the same step), then deletes the
  /// checkpoints beyond the newest `max_to_keep` and temporary files that a killed writer left.
  /// Returns the new file's path.
  /// @throws as `save_checkpoint`; the checkpoints already there are untouched when it throws.
  std::string save(const std::vector<named_tensor>& tensors, const checkpoint_metadata& metadata);

  /// The paths of this directory's checkpoints by step, oldest first (not verified).
  std::vector<std::string> checkpoints() const;

  /// The newest checkpoint that loads and verifies. A torn or corrupted newer one is skipped with
  /// a warning (`on_warning`), falling back to the one before; nullopt when none is good.
  std::optional<loaded_checkpoint> restore_latest() const;

  const std::string& directory() const noexcept { return directory_; }

private:
  std::string directory_;
  checkpoint_manager_options options_;
};

} // namespace consort
