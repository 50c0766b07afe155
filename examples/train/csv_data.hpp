#pragma once

// Real data for consort-train: a CSV file of numeric features and an integer class label,
// optionally gzip'd, read into the tensors the training loop batches; a held-out split chosen by
// a seed; and standardization of the features by the training rows' statistics.
//
// The format (docs/train.md, "Real data"):
// - One example per line, fields separated by commas; spaces and tabs around a field are ignored,
//   a field may be in double quotes ("" inside is one quote), a line may end in CRLF. Blank lines
//   are skipped. Every row has the first row's number of fields.
// - The first row is a header when none of its fields is a number; otherwise every row is data.
// - Features are numbers (as strtod reads them, finite and within float32's range); the label is
//   a class index: an integer >= 0 (3 and 3.0 are the same class). The classes are 0 .. the
//   largest label.
// - A file that starts with gzip's magic bytes (1f 8b) is decompressed (zlib), whatever its name;
//   concatenated gzip members are read one after the other, as gunzip does.

#include "mlp.hpp"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace consort::train {

/// A data file that cannot be read, with where: `what()` is "FILE, line L, column C: PROBLEM;
/// expected WHAT" (line and column 1-based; the column counts fields), or "FILE: PROBLEM" for a
/// problem of the whole file (missing, empty, a bad gzip stream before the first line).
class data_error : public std::runtime_error {
public:
  data_error(std::string path, int64_t line, int64_t column, const std::string& message);

  const std::string& path() const { return path_; }
  /// 1-based; 0 when the problem is not on one line.
  int64_t line() const { return line_; }
  /// 1-based field number; 0 when the problem is not in one field.
  int64_t column() const { return column_; }

private:
  std::string path_;
  int64_t line_;
  int64_t column_;
};

/// How `read_csv` finds the label.
struct csv_options {
  /// The label's column: a header name, or a 1-based column number ("65"); a text that is a
  /// whole number is always a column number. Empty: the last column.
  std::string label_column;
  /// The largest number of classes accepted: a label of `max_classes` or more is refused, since
  /// it would size the model's output layer (a stray 1e9 would ask for 4 GB of weights).
  int max_classes = 1000;
};

/// A data file's contents.
struct csv_data {
  /// float32 [rows, features] and int32 [rows], in the file's order.
  dataset_tensors data;
  /// 1 + the largest label (at least 2).
  int classes = 0;
  /// The header's names of the feature columns, in order (empty without a header).
  std::vector<std::string> feature_names;
  /// The label column: its 1-based number, and its header name (empty without a header).
  int64_t label_column = 0;
  std::string label_name;
  bool has_header = false;
  /// Whether the file was gzip'd.
  bool gzipped = false;
};

/// Reads `path` (see the format above).
/// @throws data_error naming the file and, for a problem in a row, the line and column: a missing
///         or unreadable file, a bad gzip stream (corrupt or truncated), an empty file or one with
///         a header and no rows, a row with more or fewer fields than the first, an empty field or
///         one that is not a finite number within float32's range, a label that is negative, not
///         an integer or >= `max_classes`, fewer than 2 classes, no column besides the label, and
///         a `label_column` that names no column.
csv_data read_csv(const std::string& path, const csv_options& options = {});

/// The training rows and the held-out rows of a data set.
struct data_split {
  dataset_tensors train;
  /// Empty tensors ([0, features] and [0]) when nothing is held out.
  dataset_tensors test;
};

/// Holds out round(`test_fraction` x rows) rows chosen by `seed`: a Fisher-Yates shuffle of the
/// row numbers driven by splitmix64 (the same on every machine and library), whose first rows
/// are held out and the rest train, each part in shuffled order (so the training batches mix the
/// file's order). Equal inputs give equal bytes on every worker.
/// @throws std::invalid_argument unless 0 <= test_fraction < 1 and at least one row trains.
data_split split_rows(const dataset_tensors& all, double test_fraction, uint64_t seed);

/// Standardizes every feature column of `split` in place by the mean and standard deviation of
/// its training rows (x' = (x - mean) / std; a column constant over the training rows is only
/// centred), and the held-out rows by the same statistics, as scikit-learn's StandardScaler fit on
/// the training split. Statistics are computed in float64.
/// Returns them as float32 tensors of one value per feature: `mean` and `scale` (1 / std, or 1 for
/// a constant column), so that a server can feed the model what it was trained on
/// (x' = (x - mean) * scale; the demo saves them in its checkpoints as `input_mean` and
/// `input_scale`, which examples/serve reads).
struct feature_scaling {
  tensor mean;
  tensor scale;
};
feature_scaling standardize(data_split& split);

} // namespace consort::train
