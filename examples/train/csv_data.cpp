#include "csv_data.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

namespace consort::train {

namespace {

std::string where(const std::string& path, int64_t line, int64_t column) {
  std::string out = path;
  if (line > 0)
    out += ", line " + std::to_string(line);
  if (column > 0)
    out += ", column " + std::to_string(column);
  return out;
}

/// A field's text for a message: quoted, cut at 40 characters, bytes outside printable ASCII as
/// '?' (a binary file's bytes would otherwise reach the terminal).
std::string shown(std::string_view text) {
  std::string out{text.substr(0, 40)};
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e)
      c = '?';
  return "\"" + out + (text.size() > 40 ? "...\"" : "\"");
}

// -- bytes ----------------------------------------------------------------------------------------

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw data_error(path, 0, 0,
                     std::string{"cannot open the data file: "} + std::strerror(errno) +
                         "; expected a CSV file (optionally gzip'd) given by --data");
  std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad())
    throw data_error(path, 0, 0,
                     std::string{"reading the data file failed: "} + std::strerror(errno));
  return bytes;
}

bool is_gzip(const std::string& bytes) {
  return bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x1f &&
         static_cast<unsigned char>(bytes[1]) == 0x8b;
}

/// The lines that `text` holds so far, for a gzip error's message.
int64_t lines_in(const std::string& text) {
  return static_cast<int64_t>(std::count(text.begin(), text.end(), '\n'));
}

/// Decompresses every gzip member of `bytes`, one after the other (as gunzip does).
std::string gunzip(const std::string& path, const std::string& bytes) {
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK)
    throw data_error(path, 0, 0, "zlib could not start a gzip stream");
  struct ender {
    z_stream& z;
    ~ender() { inflateEnd(&z); }
  } end{z};
  std::string out;
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  char chunk[1 << 16];
  auto fail = [&](const std::string& problem) -> data_error {
    const auto offset = static_cast<int64_t>(bytes.size() - z.avail_in);
    return data_error(path, 0, 0,
                      "bad gzip stream at byte " + std::to_string(offset) + " of the file (" +
                          std::to_string(lines_in(out)) + " whole lines decompressed): " + problem +
                          "; expected a whole gzip file (gzip -t checks one)");
  };
  for (;;) {
    z.next_out = reinterpret_cast<Bytef*>(chunk);
    z.avail_out = sizeof chunk;
    const int rc = inflate(&z, Z_NO_FLUSH);
    out.append(chunk, sizeof chunk - z.avail_out);
    if (rc == Z_STREAM_END) {
      if (z.avail_in == 0)
        return out;
      // Another member follows (as `cat a.gz b.gz` makes); trailing zero padding is allowed.
      const auto* rest = z.next_in;
      if (std::all_of(rest, rest + z.avail_in, [](Bytef b) { return b == 0; }))
        return out;
      if (inflateReset(&z) != Z_OK)
        throw fail("zlib could not start the next member");
      continue;
    }
    if (rc == Z_OK)
      continue;
    if (rc == Z_BUF_ERROR && z.avail_in == 0)
      throw fail("the stream ends early (a truncated file?)");
    throw fail(std::string{z.msg ? z.msg : "zlib error " + std::to_string(rc)} + " (zlib)");
  }
}

// -- fields ---------------------------------------------------------------------------------------

bool blank(char c) {
  return c == ' ' || c == '\t';
}

std::string_view trimmed(std::string_view s) {
  while (!s.empty() && blank(s.front()))
    s.remove_prefix(1);
  while (!s.empty() && blank(s.back()))
    s.remove_suffix(1);
  return s;
}

/// Splits one line into its fields: commas separate them, a field in double quotes may hold
/// commas and "" (one quote).
std::vector<std::string> fields_of(const std::string& path, int64_t line_no,
                                   std::string_view line) {
  std::vector<std::string> fields;
  size_t i = 0;
  for (;;) {
    // Spaces before a quoted field are allowed.
    size_t start = i;
    while (start < line.size() && blank(line[start]))
      ++start;
    if (start < line.size() && line[start] == '"') {
      std::string field;
      size_t j = start + 1;
      for (;;) {
        if (j >= line.size())
          throw data_error(path, line_no, static_cast<int64_t>(fields.size()) + 1,
                           "a quoted field has no closing quote; expected \"...\" on one line");
        if (line[j] == '"') {
          if (j + 1 < line.size() && line[j + 1] == '"') {
            field += '"';
            j += 2;
            continue;
          }
          ++j;
          break;
        }
        field += line[j++];
      }
      while (j < line.size() && blank(line[j]))
        ++j;
      if (j < line.size() && line[j] != ',')
        throw data_error(path, line_no, static_cast<int64_t>(fields.size()) + 1,
                         "text after a quoted field's closing quote; expected a comma");
      fields.push_back(field);
      if (j >= line.size())
        return fields;
      i = j + 1;
      continue;
    }
    size_t comma = line.find(',', i);
    fields.emplace_back(
        trimmed(line.substr(i, comma == std::string_view::npos ? line.npos : comma - i)));
    if (comma == std::string_view::npos)
      return fields;
    i = comma + 1;
  }
}

enum class number_problem { none, empty, not_a_number, not_finite, out_of_range };

/// The number `text` holds (as strtod reads it in the C locale; a leading + is allowed).
number_problem parse_number(std::string_view text, double& value) {
  if (text.empty())
    return number_problem::empty;
  std::string_view digits = text.front() == '+' ? text.substr(1) : text;
  const char* end = digits.data() + digits.size();
  auto [ptr, ec] = std::from_chars(digits.data(), end, value);
  if (ec == std::errc::result_out_of_range)
    return number_problem::out_of_range;
  // "+-5" and "++5" are no numbers; from_chars itself takes no '+'.
  if (ec != std::errc{} || ptr != end || digits.empty() || digits.front() == '+' ||
      (digits.front() == '-' && text.front() == '+'))
    return number_problem::not_a_number;
  if (!std::isfinite(value))
    return number_problem::not_finite;
  return number_problem::none;
}

bool is_number(std::string_view text) {
  double ignored = 0;
  return parse_number(text, ignored) == number_problem::none;
}

/// The 1-based label column that `wanted` names among `columns` fields.
int64_t label_column_of(const std::string& path, const std::string& wanted, size_t columns,
                        const std::vector<std::string>& header) {
  if (wanted.empty())
    return static_cast<int64_t>(columns);
  const bool digits =
      std::all_of(wanted.begin(), wanted.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (digits) {
    int64_t index = 0;
    auto [ptr, ec] = std::from_chars(wanted.data(), wanted.data() + wanted.size(), index);
    if (ec != std::errc{} || index < 1 || index > static_cast<int64_t>(columns))
      throw data_error(path, 0, 0,
                       "--label-column " + wanted +
                           " is not a column of this file; expected a "
                           "column number from 1 to " +
                           std::to_string(columns) +
                           (header.empty() ? std::string{} : " or a header name"));
    return index;
  }
  if (header.empty())
    throw data_error(path, 0, 0,
                     "--label-column \"" + wanted +
                         "\" names a column, and this file has no "
                         "header row (its first row is numbers); expected a column number from 1 "
                         "to " +
                         std::to_string(columns));
  auto it = std::find(header.begin(), header.end(), wanted);
  if (it == header.end()) {
    std::string names;
    for (size_t i = 0; i < header.size() && i < 8; ++i)
      names += (i ? ", " : "") + shown(header[i]);
    if (header.size() > 8)
      names += ", ...";
    throw data_error(path, 1, 0,
                     "--label-column \"" + wanted + "\" is not in the header; expected one of " +
                         names + " or a column number from 1 to " + std::to_string(columns));
  }
  return static_cast<int64_t>(it - header.begin()) + 1;
}

constexpr const char* expected_label = "expected a class index: an integer 0, 1, 2, ...";

/// The label `text` holds.
int32_t parse_label(const std::string& path, int64_t line, int64_t column, std::string_view text,
                    int max_classes) {
  double v = 0;
  switch (parse_number(text, v)) {
  case number_problem::none:
    break;
  case number_problem::empty:
    throw data_error(path, line, column, "the label is empty; " + std::string{expected_label});
  default:
    throw data_error(path, line, column,
                     "the label " + shown(text) + " is not a number; " + expected_label +
                         " (class names are not read: map them to 0, 1, 2, ... first)");
  }
  if (v < 0)
    throw data_error(path, line, column,
                     "the label " + shown(text) + " is negative; " + std::string{expected_label});
  if (v != std::floor(v))
    throw data_error(path, line, column,
                     "the label " + shown(text) + " is not an integer; " + expected_label);
  if (v >= max_classes)
    throw data_error(path, line, column,
                     "the label " + shown(text) + " would make more than " +
                         std::to_string(max_classes) + " classes (--max-classes); " +
                         expected_label + " below " + std::to_string(max_classes));
  return static_cast<int32_t>(v);
}

float parse_feature(const std::string& path, int64_t line, int64_t column, std::string_view text,
                    bool first_row) {
  double v = 0;
  const std::string expected = "expected a number such as 0, 1.5 or -2e3";
  const std::string header_hint =
      first_row ? " (a first row is a header only when none of its fields is a number)" : "";
  switch (parse_number(text, v)) {
  case number_problem::none:
    break;
  case number_problem::empty:
    throw data_error(path, line, column, "the field is empty; " + expected + header_hint);
  case number_problem::not_finite:
    throw data_error(path, line, column,
                     shown(text) + " is not a finite number; " + expected + header_hint);
  case number_problem::out_of_range:
    throw data_error(path, line, column,
                     shown(text) + " is out of float32's range; " + expected + header_hint);
  case number_problem::not_a_number:
    throw data_error(path, line, column,
                     shown(text) + " is not a number; " + expected + header_hint);
  }
  if (std::fabs(v) > std::numeric_limits<float>::max())
    throw data_error(path, line, column,
                     shown(text) + " is out of float32's range; " + expected + header_hint);
  return static_cast<float>(v);
}

// -- splitting ------------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

dataset_tensors take_rows(const dataset_tensors& all, const std::vector<int64_t>& rows) {
  const int64_t features = all.x.shape()[1];
  const float* x = all.x.data<float>();
  const int32_t* y = all.y.data<int32_t>();
  std::vector<float> xs;
  std::vector<int32_t> ys;
  xs.reserve(rows.size() * static_cast<size_t>(features));
  ys.reserve(rows.size());
  for (int64_t r : rows) {
    xs.insert(xs.end(), x + r * features, x + (r + 1) * features);
    ys.push_back(y[r]);
  }
  const auto n = static_cast<int64_t>(rows.size());
  return {tensor::from<float>(xs, {n, features}), tensor::from<int32_t>(ys, {n})};
}

} // namespace

data_error::data_error(std::string path, int64_t line, int64_t column, const std::string& message)
    : std::runtime_error(where(path, line, column) + ": " + message), path_(std::move(path)),
      line_(line), column_(column) {}

csv_data read_csv(const std::string& path, const csv_options& options) {
  if (options.max_classes < 2)
    throw data_error(path, 0, 0,
                     "--max-classes " + std::to_string(options.max_classes) +
                         " leaves no room for 2 classes; expected at least 2");
  csv_data out;
  std::string text = read_file(path);
  out.gzipped = is_gzip(text);
  if (out.gzipped)
    text = gunzip(path, text);

  std::vector<std::string> header;
  std::vector<float> xs;
  std::vector<int32_t> ys;
  size_t columns = 0;
  int64_t label = 0; // 1-based
  int64_t first_line = 0;
  int64_t rows = 0;
  int64_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string_view line{text.data() + pos, (nl == std::string::npos ? text.size() : nl) - pos};
    pos = nl == std::string::npos ? text.size() : nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r')
      line.remove_suffix(1);
    if (trimmed(line).empty())
      continue;
    auto fields = fields_of(path, line_no, line);
    if (columns == 0) {
      columns = fields.size();
      first_line = line_no;
      if (std::none_of(fields.begin(), fields.end(), [](const auto& f) { return is_number(f); })) {
        header = fields;
        out.has_header = true;
      }
      if (columns < 2)
        throw data_error(path, line_no, 0,
                         "the first row has 1 column; expected at least 2 (features, then the "
                         "label or as --label-column says)");
      label = label_column_of(path, options.label_column, columns, header);
      if (out.has_header)
        continue;
    }
    if (fields.size() != columns) {
      const bool fewer = fields.size() < columns;
      throw data_error(path, line_no, static_cast<int64_t>(fewer ? fields.size() + 1 : columns + 1),
                       "this row has " + std::to_string(fields.size()) + " columns, " +
                           (fewer ? "fewer" : "more") + " than the first row (line " +
                           std::to_string(first_line) + "); expected " + std::to_string(columns) +
                           " comma-separated columns on every row");
    }
    for (size_t c = 0; c < columns; ++c) {
      const auto column = static_cast<int64_t>(c) + 1;
      if (column == label)
        ys.push_back(parse_label(path, line_no, column, fields[c], options.max_classes));
      else
        xs.push_back(parse_feature(path, line_no, column, fields[c], line_no == first_line));
    }
    ++rows;
  }
  if (columns == 0)
    throw data_error(path, 0, 0,
                     std::string{"the file is empty"} +
                         (out.gzipped ? " (once decompressed)" : "") +
                         "; expected rows of comma-separated numbers, the label in one column");
  if (rows == 0)
    throw data_error(path, first_line, 0,
                     "the file has a header row and no data rows; expected rows of "
                     "comma-separated numbers after the header");
  const int32_t largest = *std::max_element(ys.begin(), ys.end());
  if (largest < 1)
    throw data_error(path, 0, label,
                     "every label is 0: one class; expected labels of at least 2 classes (0 and "
                     "1 or more)");
  const auto features = static_cast<int64_t>(columns) - 1;
  out.data = {tensor::from<float>(xs, {rows, features}), tensor::from<int32_t>(ys, {rows})};
  out.classes = largest + 1;
  out.label_column = label;
  if (out.has_header) {
    out.label_name = header[static_cast<size_t>(label - 1)];
    for (size_t c = 0; c < columns; ++c)
      if (static_cast<int64_t>(c) + 1 != label)
        out.feature_names.push_back(header[c]);
  }
  return out;
}

data_split split_rows(const dataset_tensors& all, double test_fraction, uint64_t seed) {
  const int64_t rows = all.y.num_elements();
  if (!(test_fraction >= 0 && test_fraction < 1))
    throw std::invalid_argument("--test-fraction must be at least 0 and below 1; got " +
                                std::to_string(test_fraction));
  const auto held = static_cast<int64_t>(std::llround(test_fraction * static_cast<double>(rows)));
  if (rows - held < 1)
    throw std::invalid_argument("--test-fraction " + std::to_string(test_fraction) + " of " +
                                std::to_string(rows) + " rows leaves no row to train on");
  std::vector<int64_t> order(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    order[static_cast<size_t>(i)] = i;
  // Fisher-Yates from the last row down; the modulo's bias (under 2^-40 for any file that fits
  // in memory) does not matter, its sameness everywhere does.
  uint64_t state = seed;
  for (int64_t i = rows - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(i + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  const auto cut = order.begin() + held;
  return {take_rows(all, std::vector<int64_t>(cut, order.end())),
          take_rows(all, std::vector<int64_t>(order.begin(), cut))};
}

feature_scaling standardize(data_split& split) {
  const int64_t features = split.train.x.shape()[1];
  const int64_t rows = split.train.x.shape()[0];
  std::vector<double> mean(static_cast<size_t>(features)), scale(static_cast<size_t>(features));
  const float* x = split.train.x.data<float>();
  for (int64_t f = 0; f < features; ++f) {
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r)
      sum += x[r * features + f];
    const double m = rows > 0 ? sum / static_cast<double>(rows) : 0;
    double squares = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const double d = x[r * features + f] - m;
      squares += d * d;
    }
    const double sd = rows > 0 ? std::sqrt(squares / static_cast<double>(rows)) : 0;
    mean[static_cast<size_t>(f)] = m;
    scale[static_cast<size_t>(f)] = sd > 0 ? 1 / sd : 1;
  }
  for (tensor* t : {&split.train.x, &split.test.x}) {
    if (t->num_elements() == 0)
      continue;
    float* v = t->mutable_data<float>();
    const int64_t n = t->shape()[0];
    for (int64_t r = 0; r < n; ++r)
      for (int64_t f = 0; f < features; ++f) {
        float& e = v[r * features + f];
        e = static_cast<float>((e - mean[static_cast<size_t>(f)]) * scale[static_cast<size_t>(f)]);
      }
  }
  feature_scaling out;
  out.mean = tensor::from(std::vector<float>(mean.begin(), mean.end()));
  out.scale = tensor::from(std::vector<float>(scale.begin(), scale.end()));
  return out;
}

} // namespace consort::train
