// The demo's reader of real data (examples/train/csv_data.hpp): CSV and gzip'd CSV files, the
// header and the label column, every bad file's message (file, line, column, what was expected),
// the seeded held-out split, the standardization, and the digits data set of python3-sklearn.

#include "csv_data.hpp"
#include "trainer.hpp"

#include <consort/consort.hpp>

#include <gtest/gtest.h>
#include <zlib.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

using namespace consort;
using namespace consort::train;

namespace {

/// A file in the temporary directory with the given bytes, removed at the end of the test.
class data_file {
public:
  data_file(const std::string& name, const std::string& bytes)
      : path_((std::filesystem::temp_directory_path() /
               ("consort_csv_" + std::to_string(::getpid()) + "_" + name))
                  .string()) {
    std::ofstream out(path_, std::ios::binary);
    out << bytes;
  }
  ~data_file() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

private:
  std::string path_;
};

/// `text` as a gzip member (zlib's deflate with a gzip header).
std::string gzipped(const std::string& text) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, text.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(out.size() - z.avail_out);
  deflateEnd(&z);
  return out;
}

/// The message of the data_error that reading `bytes` throws, checked to name `line` and
/// `column` (0: none); "" when nothing is thrown.
std::string error_of(const std::string& bytes, int64_t line, int64_t column,
                     const csv_options& options = {}) {
  data_file file("bad.csv", bytes);
  try {
    read_csv(file.path(), options);
  } catch (const data_error& e) {
    EXPECT_EQ(e.path(), file.path());
    EXPECT_EQ(e.line(), line) << e.what();
    EXPECT_EQ(e.column(), column) << e.what();
    std::string where = file.path();
    if (line > 0)
      where += ", line " + std::to_string(line);
    if (column > 0)
      where += ", column " + std::to_string(column);
    EXPECT_EQ(std::string{e.what()}.rfind(where + ": ", 0), 0u) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error reading " << bytes;
  return "";
}

const char* digits_path() {
  return CONSORT_DIGITS_CSV;
}

} // namespace

TEST(CsvData, ReadsAHeaderlessFileWithTheLabelInTheLastColumn) {
  data_file file("plain.csv", "0.5,1,2\n-3e-1, 4 ,0\n+7,8.25,1\n");
  auto got = read_csv(file.path());
  EXPECT_FALSE(got.has_header);
  EXPECT_FALSE(got.gzipped);
  EXPECT_EQ(got.classes, 3);
  EXPECT_EQ(got.label_column, 3);
  EXPECT_EQ(got.data.x.shape(), (shape_t{3, 2}));
  EXPECT_EQ(got.data.x.to_vector<float>(), (std::vector<float>{0.5f, 1, -0.3f, 4, 7, 8.25f}));
  EXPECT_EQ(got.data.y.to_vector<int32_t>(), (std::vector<int32_t>{2, 0, 1}));
}

TEST(CsvData, DetectsAHeaderAndFindsTheLabelByNameOrNumber) {
  // CRLF line ends, a quoted name with a comma, blank lines, "3.0" as class 3.
  const std::string text = "label,\"a, b\",c\r\n\r\n3.0,1,2\r\n1,3,4\r\n   \r\n";
  data_file file("header.csv", text);
  csv_options by_name;
  by_name.label_column = "label";
  auto got = read_csv(file.path(), by_name);
  EXPECT_TRUE(got.has_header);
  EXPECT_EQ(got.label_name, "label");
  EXPECT_EQ(got.label_column, 1);
  EXPECT_EQ(got.feature_names, (std::vector<std::string>{"a, b", "c"}));
  EXPECT_EQ(got.classes, 4);
  EXPECT_EQ(got.data.x.to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(got.data.y.to_vector<int32_t>(), (std::vector<int32_t>{3, 1}));
  csv_options by_number;
  by_number.label_column = "1";
  EXPECT_EQ(read_csv(file.path(), by_number).data.y.to_vector<int32_t>(),
            (std::vector<int32_t>{3, 1}));
  // The default is the last column, "c".
  EXPECT_EQ(read_csv(file.path()).data.y.to_vector<int32_t>(), (std::vector<int32_t>{2, 4}));
}

TEST(CsvData, AGzipFileReadsAsItsTextAndConcatenatedMembersFollowOneAnother) {
  const std::string text = "1,2,0\n3,4,1\n";
  data_file plain("same.csv", text);
  data_file packed("same.csv.gz", gzipped(text));
  auto a = read_csv(plain.path());
  auto b = read_csv(packed.path());
  EXPECT_TRUE(b.gzipped);
  EXPECT_EQ(a.data.x, b.data.x);
  EXPECT_EQ(a.data.y, b.data.y);
  data_file two("two.gz", gzipped("1,2,0\n") + gzipped("3,4,1\n"));
  EXPECT_EQ(read_csv(two.path()).data.y.to_vector<int32_t>(), (std::vector<int32_t>{0, 1}));
}

TEST(CsvData, AMissingFileIsNamedWithTheSystemsReason) {
  csv_options none;
  try {
    read_csv("/nonexistent/digits.csv", none);
    FAIL() << "no error";
  } catch (const data_error& e) {
    EXPECT_EQ(std::string{e.what()}, "/nonexistent/digits.csv: cannot open the data file: No such "
                                     "file or directory; expected a CSV file (optionally gzip'd) "
                                     "given by --data");
  }
}

TEST(CsvData, EmptyFilesAreRefused) {
  EXPECT_NE(error_of("", 0, 0).find("the file is empty; expected rows"), std::string::npos);
  EXPECT_NE(error_of("\n  \n\r\n", 0, 0).find("the file is empty"), std::string::npos);
  EXPECT_NE(error_of(gzipped(""), 0, 0).find("the file is empty (once decompressed)"),
            std::string::npos);
  EXPECT_NE(error_of("\na,b,label\n", 2, 0).find("a header row and no data rows"),
            std::string::npos);
}

TEST(CsvData, ARaggedRowNamesItsLineAndTheFirstMissingOrExtraColumn) {
  auto fewer = error_of("1,2,0\n3,4,1\n5,1\n", 3, 3);
  EXPECT_NE(fewer.find("this row has 2 columns, fewer than the first row (line 1); expected 3 "
                       "comma-separated columns on every row"),
            std::string::npos)
      << fewer;
  auto more = error_of("x,y,label\n1,2,0\n3,4,1,9\n", 3, 4);
  EXPECT_NE(more.find("this row has 4 columns, more than the first row (line 1)"),
            std::string::npos)
      << more;
}

TEST(CsvData, ANonNumberNamesItsLineColumnAndText) {
  auto text = error_of("1,2,0\n3,abc,1\n", 2, 2);
  EXPECT_NE(text.find("\"abc\" is not a number; expected a number such as 0, 1.5 or -2e3"),
            std::string::npos)
      << text;
  EXPECT_NE(error_of("1,2,0\n3,,1\n", 2, 2).find("the field is empty"), std::string::npos);
  EXPECT_NE(error_of("1,nan,0\n", 1, 2).find("\"nan\" is not a finite number"), std::string::npos);
  EXPECT_NE(error_of("1,2,0\n1e39,2,1\n", 2, 1).find("out of float32's range"), std::string::npos);
  EXPECT_NE(error_of("1,2,0\n1e999,2,1\n", 2, 1).find("out of float32's range"), std::string::npos);
  EXPECT_NE(error_of("1,2,0\n+-1,2,1\n", 2, 1).find("is not a number"), std::string::npos);
  EXPECT_NE(error_of("1,2,0\n0x10,2,1\n", 2, 1).find("is not a number"), std::string::npos);
  // A first row with some numbers is data, and says how a header is recognized.
  EXPECT_NE(error_of("1,b,0\n3,4,1\n", 1, 2)
                .find("a first row is a header only when none of its "
                      "fields is a number"),
            std::string::npos);
  // A binary field is shown with '?' for its bytes, cut at 40 characters.
  auto binary = error_of("1,2,0\n3," + std::string(50, '\x01') + ",1\n", 2, 2);
  EXPECT_NE(binary.find("\"" + std::string(40, '?') + "...\" is not a number"), std::string::npos)
      << binary;
  EXPECT_NE(error_of("1,\"2,0\n", 1, 2).find("a quoted field has no closing quote"),
            std::string::npos);
}

TEST(CsvData, ALabelOutOfRangeIsRefusedSayingWhatAClassIs) {
  auto negative = error_of("1,2,0\n3,4,-1\n", 2, 3);
  EXPECT_NE(negative.find("the label \"-1\" is negative; expected a class index: an integer 0, 1, "
                          "2, ..."),
            std::string::npos)
      << negative;
  EXPECT_NE(error_of("1,2,0\n3,4,2.5\n", 2, 3).find("the label \"2.5\" is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of("1,2,0\n3,4,cat\n", 2, 3).find("class names are not read"), std::string::npos);
  EXPECT_NE(error_of("1,2,0\n3,4,\n", 2, 3).find("the label is empty"), std::string::npos);
  auto many = error_of("1,2,0\n3,4,1000\n", 2, 3);
  EXPECT_NE(many.find("the label \"1000\" would make more than 1000 classes (--max-classes)"),
            std::string::npos)
      << many;
  csv_options few;
  few.max_classes = 3;
  EXPECT_NE(error_of("1,2,0\n3,4,3\n", 2, 3, few).find("more than 3 classes"), std::string::npos);
  EXPECT_NE(error_of("1,2,0\n3,4,0\n", 0, 3).find("every label is 0: one class"),
            std::string::npos);
}

TEST(CsvData, ALabelColumnThatNamesNoColumnIsRefused) {
  csv_options o;
  o.label_column = "4";
  EXPECT_NE(error_of("1,2,0\n", 0, 0, o)
                .find("--label-column 4 is not a column of this file; "
                      "expected a column number from 1 to 3"),
            std::string::npos);
  o.label_column = "0";
  EXPECT_NE(error_of("1,2,0\n", 0, 0, o).find("from 1 to 3"), std::string::npos);
  o.label_column = "digit";
  EXPECT_NE(error_of("1,2,0\n", 0, 0, o).find("this file has no header row"), std::string::npos);
  EXPECT_NE(error_of("a,b,label\n1,2,0\n", 1, 0, o)
                .find("--label-column \"digit\" is not in the header; expected one of \"a\", "
                      "\"b\", \"label\" or a column number from 1 to 3"),
            std::string::npos);
  EXPECT_NE(error_of("7\n8\n", 1, 0).find("the first row has 1 column"), std::string::npos);
}

TEST(CsvData, ABadGzipStreamNamesTheByteAndTheLinesBeforeIt) {
  std::string text;
  for (int i = 0; i < 2000; ++i)
    text +=
        std::to_string(i) + "," + std::to_string(i * 7 % 13) + "," + std::to_string(i % 3) + "\n";
  const std::string whole = gzipped(text);
  auto truncated = error_of(whole.substr(0, whole.size() / 2), 0, 0);
  EXPECT_NE(truncated.find("bad gzip stream at byte"), std::string::npos) << truncated;
  EXPECT_NE(truncated.find("the stream ends early (a truncated file?)"), std::string::npos)
      << truncated;
  EXPECT_NE(truncated.find("expected a whole gzip file"), std::string::npos);
  // A flipped byte in the checksum at the end, then one in the compressed data.
  std::string bad_crc = whole;
  bad_crc[bad_crc.size() - 6] ^= 0x55;
  EXPECT_NE(error_of(bad_crc, 0, 0).find("incorrect data check (zlib)"), std::string::npos);
  std::string corrupt = whole;
  for (size_t i = 20; i < 40; ++i)
    corrupt[i] = static_cast<char>(0xff);
  auto message = error_of(corrupt, 0, 0);
  EXPECT_NE(message.find("(zlib)"), std::string::npos) << message;
  // Two magic bytes and nothing more.
  EXPECT_NE(error_of(std::string{"\x1f\x8b"}, 0, 0).find("bad gzip stream at byte"),
            std::string::npos);
}

TEST(CsvData, TheSplitIsAPartitionChosenByTheSeed) {
  synthetic_options s;
  s.examples = 100;
  auto all = make_dataset(s);
  auto a = split_rows(all, 0.25, 7);
  auto again = split_rows(all, 0.25, 7);
  auto other = split_rows(all, 0.25, 8);
  EXPECT_EQ(a.test.y.num_elements(), 25);
  EXPECT_EQ(a.train.y.num_elements(), 75);
  EXPECT_EQ(a.train.x, again.train.x);
  EXPECT_EQ(a.test.x, again.test.x);
  EXPECT_NE(a.test.x, other.test.x);
  // Every row lands in exactly one part: the rows' first features (distinct here) as multisets.
  auto firsts = [](const dataset_tensors& d) {
    std::multiset<float> out;
    auto v = d.x.to_vector<float>();
    for (size_t r = 0; r < v.size(); r += 16)
      out.insert(v[r]);
    return out;
  };
  auto together = firsts(a.train);
  auto held = firsts(a.test);
  together.insert(held.begin(), held.end());
  EXPECT_EQ(together, firsts(all));
  // Nothing held out: every row trains, shuffled out of the file's order.
  auto none = split_rows(all, 0, 7);
  EXPECT_EQ(none.test.y.num_elements(), 0);
  EXPECT_EQ(none.test.x.shape(), (shape_t{0, 16}));
  EXPECT_EQ(firsts(none.train), firsts(all));
  EXPECT_NE(none.train.x, all.x);
  EXPECT_THROW(split_rows(all, 1, 7), std::invalid_argument);
  EXPECT_THROW(split_rows(all, -0.1, 7), std::invalid_argument);
  EXPECT_THROW(split_rows(all, 0.999, 7), std::invalid_argument); // no row left to train
}

TEST(CsvData, StandardizationUsesTheTrainingRowsStatisticsForBothParts) {
  data_split split;
  split.train = {tensor::from<float>({1, 5, 3, 5, 5, 5}, {3, 2}), tensor::from<int32_t>({0, 1, 0})};
  split.test = {tensor::from<float>({7, 6}, {1, 2}), tensor::from<int32_t>({1})};
  auto scaling = standardize(split);
  // Column 0: mean 3, standard deviation sqrt(8/3); column 1 is constant: centred only.
  const double sd = std::sqrt(8.0 / 3.0);
  // The statistics it returns (saved in checkpoints for a server): x' = (x - mean) * scale.
  EXPECT_EQ(scaling.mean.to_vector<float>(), (std::vector<float>{3, 5}));
  auto scale = scaling.scale.to_vector<float>();
  ASSERT_EQ(scale.size(), 2u);
  EXPECT_FLOAT_EQ(scale[0], static_cast<float>(1 / sd));
  EXPECT_EQ(scale[1], 1.0f);
  auto train = split.train.x.to_vector<float>();
  EXPECT_FLOAT_EQ(train[0], static_cast<float>(-2 / sd));
  EXPECT_FLOAT_EQ(train[2], 0.0f);
  EXPECT_FLOAT_EQ(train[4], static_cast<float>(2 / sd));
  EXPECT_EQ(train[1], 0.0f);
  EXPECT_EQ(train[5], 0.0f);
  auto test = split.test.x.to_vector<float>();
  EXPECT_FLOAT_EQ(test[0], static_cast<float>(4 / sd));
  EXPECT_EQ(test[1], 1.0f);
}

TEST(CsvData, ReadsTheDigitsOfScikitLearn) {
  if (std::string{digits_path()}.empty())
    GTEST_SKIP() << "digits.csv.gz not found at configure time (tools/setup.sh installs "
                    "python3-sklearn)";
  auto got = read_csv(digits_path());
  EXPECT_TRUE(got.gzipped);
  EXPECT_FALSE(got.has_header);
  EXPECT_EQ(got.data.x.shape(), (shape_t{1797, 64}));
  EXPECT_EQ(got.classes, 10);
  std::vector<int> counts(10);
  for (int32_t label : got.data.y.to_vector<int32_t>())
    ++counts[static_cast<size_t>(label)];
  for (int c : counts) // 174 to 183 images of each digit
    EXPECT_TRUE(c >= 170 && c <= 185) << c;
  for (float v : got.data.x.to_vector<float>())
    ASSERT_TRUE(v >= 0 && v <= 16 && v == std::floor(v)) << v;
}

TEST(CsvData, OnDigitsOneStepOfTwoReplicasMatchesOneAndOneChangedRowDoesNot) {
  // The demo's --verify on --data checks the first step (docs/train.md, "Real data"): two
  // replicas agree with one within the tolerance, and one changed row is far outside it.
  if (std::string{digits_path()}.empty())
    GTEST_SKIP() << "digits.csv.gz not found at configure time";
  auto split = split_rows(read_csv(digits_path()).data, 0.2, 42);
  standardize(split);
  train_options o;
  o.steps = 1;
  o.classes = 10;
  o.examples = split.train.y.num_elements();
  tracer off(false);
  one_device_strategy one("CPU:0");
  mirrored_strategy two({"CPU:0", "CPU:1"});
  auto a = train_on(one, o, split.train, off, 0);
  auto b = train_on(two, o, split.train, off, 0);
  EXPECT_LE(max_relative_difference(a.params, b.params), verify_tolerance / 5);
  auto changed = split.train;
  changed.y = changed.y.clone();
  auto* y = changed.y.mutable_data<int32_t>();
  y[100] = (y[100] + 1) % 10;
  auto c = train_on(one, o, changed, off, 0);
  EXPECT_GT(max_relative_difference(a.params, c.params), 10 * verify_tolerance);
}

TEST(CsvData, EvaluateCountsTheRowsWhoseHighestLogitIsTheLabel) {
  synthetic_options s;
  s.examples = 300;
  auto data = make_dataset(s);
  auto params = init_params({16, 8, 4, 1}, 3);
  auto predicted = predict(params, data.x).to_vector<int32_t>();
  auto labels = data.y.to_vector<int32_t>();
  int right = 0;
  for (size_t i = 0; i < labels.size(); ++i)
    right += predicted[i] == labels[i] ? 1 : 0;
  auto e = evaluate(params, data);
  EXPECT_EQ(e.rows, 300);
  EXPECT_DOUBLE_EQ(e.accuracy, right / 300.0);
  EXPECT_NEAR(e.loss, forward_backward(params, data.x, data.y).loss_sum.item<float>() / 300.0,
              1e-5);
  EXPECT_GT(e.loss, 0);
}
