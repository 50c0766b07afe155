// Checkpoint files and the checkpoint manager (include/consort/checkpoint.hpp): round trips of
// every dtype, the metadata, keep-last-N, and every way a file can be bad, each with the error
// that names it, while the previous good checkpoint stays usable.

#include "support/expect_error.hpp"

#include "device/checkpoint_seam.hpp"

#include <consort/checkpoint.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <sys/resource.h>

using consort::bfloat16_t;
using consort::checkpoint_manager;
using consort::checkpoint_metadata;
using consort::dtype;
using consort::errc;
using consort::float16_t;
using consort::named_tensor;
using consort::nest;
using consort::tensor;
using consort::test::fails_with;

namespace fs = std::filesystem;

namespace {

/// A fresh directory under the test's temporary directory, removed at the end.
class CheckpointTest : public ::testing::Test {
protected:
  CheckpointTest() {
    std::string pattern = (fs::temp_directory_path() / "consort-ckpt-XXXXXX").string();
    dir_ = ::mkdtemp(pattern.data());
  }
  ~CheckpointTest() override {
    consort::detail::checkpoint_clear_write_fault();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  /// The names of the files in the directory, sorted.
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& item : fs::directory_iterator(dir_))
      out.push_back(item.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::string dir_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A small model's parameters: distinct values, so that a swapped or shifted tensor shows.
nest model(float base = 0.5f, int64_t width = 3) {
  std::vector<float> w(static_cast<size_t>(width * 4));
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = base + static_cast<float>(i) * 0.25f;
  return nest::dict(
      {{"dense", nest::list({tensor::from(w, {width, 4}),
                             tensor::from(std::vector<float>{base, -base, 2.0f, -3.5f}, {4})})},
       {"step_count", tensor::scalar<int64_t>(7)}});
}

// GCC 12 warns (-Wmissing-field-initializers) about designated initializers that leave members
// out, so the tests build their options with these.
checkpoint_metadata at_step(int64_t step) {
  checkpoint_metadata m;
  m.step = step;
  return m;
}

consort::checkpoint_manager_options keeping(size_t n) {
  consort::checkpoint_manager_options o;
  o.max_to_keep = n;
  return o;
}

consort::checkpoint_manager_options named(const std::string& prefix) {
  consort::checkpoint_manager_options o;
  o.prefix = prefix;
  return o;
}

consort::checkpoint_manager_options warning_to(std::vector<std::string>& lines) {
  consort::checkpoint_manager_options o;
  o.on_warning = [&lines](const std::string& line) {
    lines.push_back(line);
  };
  return o;
}

/// The byte offset in the file where the data of tensor `name` starts.
size_t data_offset_of(const std::string& file, const std::string& name) {
  uint64_t length = 0;
  std::memcpy(&length, file.data(), 8);
  const std::string header = file.substr(8, length);
  auto at = header.find("\"" + name + "\":{\"data_offsets\":[");
  EXPECT_NE(at, std::string::npos) << header;
  auto begin = header.find('[', at) + 1;
  return 8 + length + std::stoull(header.substr(begin));
}

} // namespace

// -- round trips
// ------------------------------------------------------------------------------------

TEST_F(CheckpointTest, EveryDtypeRoundTripsBitForBit) {
  std::vector<named_tensor> tensors = {
      {"f32", tensor::from(std::vector<float>{1.5f, -0.0f, 3.25e-39f, 1e30f, -7.0f, 0.1f}, {2, 3})},
      {"f64", tensor::from(std::vector<double>{3.141592653589793, -2.5e-300}, {2})},
      {"i32", tensor::from(std::vector<int32_t>{-2147483647 - 1, 0, 2147483647}, {3, 1})},
      {"i64", tensor::from(std::vector<int64_t>{INT64_MIN, -1, INT64_MAX}, {3})},
      {"u8", tensor::from(std::vector<uint8_t>{0, 127, 255}, {1, 3})},
      {"bool", tensor::from(std::vector<bool>{true, false, true, true}, {2, 2})},
      {"f16", tensor::from(std::vector<float16_t>{float16_t{1.0f}, float16_t{-65504.0f},
                                                  float16_t::from_bits(0x0001)},
                           {3})},
      {"bf16", tensor::from(std::vector<bfloat16_t>{bfloat16_t{1.0f}, bfloat16_t{-3.0e38f}}, {2})},
      {"scalar", tensor::scalar<float>(42.0f)},
      {"empty", tensor::zeros(dtype::float32, {0, 5})},
  };
  consort::save_checkpoint(path("all.safetensors"), tensors, {});
  auto loaded = consort::load_checkpoint(path("all.safetensors"));
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const auto& want : tensors) {
    const tensor* got = loaded.find(want.name);
    ASSERT_NE(got, nullptr) << want.name;
    EXPECT_EQ(got->dtype(), want.value.dtype()) << want.name;
    EXPECT_EQ(got->shape(), want.value.shape()) << want.name;
    ASSERT_EQ(got->num_bytes(), want.value.num_bytes()) << want.name;
    EXPECT_EQ(std::memcmp(got->raw_data(), want.value.raw_data(), got->num_bytes()), 0)
        << want.name;
  }
  EXPECT_EQ(loaded.find("absent"), nullptr);
}

TEST_F(CheckpointTest, MetadataRoundTrips) {
  checkpoint_metadata meta;
  meta.step = 1234;
  meta.dataset_position = 987654321012;
  meta.rng_state = std::string("\x00\x01\xfe\xff rng", 8);
  meta.num_workers = 3;
  meta.num_replicas_in_sync = 12;
  meta.user = {{"learning_rate", "0.1"}, {"note", "quotes \" and\nnewlines"}};
  consort::save_checkpoint(path("m.safetensors"), {{"x", tensor::scalar<int32_t>(1)}}, meta);
  auto got = consort::load_checkpoint(path("m.safetensors")).metadata;
  EXPECT_EQ(got.step, 1234);
  EXPECT_EQ(got.dataset_position, 987654321012);
  EXPECT_EQ(got.rng_state, meta.rng_state);
  EXPECT_EQ(got.num_workers, 3);
  EXPECT_EQ(got.num_replicas_in_sync, 12);
  EXPECT_EQ(got.user, meta.user);
}

TEST_F(CheckpointTest, TheFileIsSafetensorsLayout) {
  consort::save_checkpoint(path("s.safetensors"),
                           {{"w", tensor::from(std::vector<float>{1, 2, 3}, {3})}}, {});
  const std::string file = read_file(path("s.safetensors"));
  uint64_t length = 0;
  std::memcpy(&length, file.data(), 8);
  EXPECT_EQ((8 + length) % 8, 0u) << "the data starts 8-byte aligned";
  const std::string header = file.substr(8, length);
  EXPECT_EQ(header.front(), '{');
  EXPECT_NE(header.find(R"("w":{"data_offsets":[0,12],"dtype":"F32","shape":[3]})"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find(R"("__metadata__":{)"), std::string::npos);
  ASSERT_EQ(file.size(), 8 + length + 12);
  float values[3];
  std::memcpy(values, file.data() + 8 + length, 12);
  EXPECT_EQ(values[2], 3.0f);
}

TEST_F(CheckpointTest, ANestRestoresIntoItsStructureByPath) {
  const nest params = model(0.5f);
  auto names = consort::named_leaves(params);
  ASSERT_EQ(names.size(), 3u);
  EXPECT_EQ(names[0].name, "dense/0");
  EXPECT_EQ(names[1].name, "dense/1");
  EXPECT_EQ(names[2].name, "step_count");
  EXPECT_EQ(consort::named_leaves(nest(tensor::scalar<float>(1)))[0].name, "value");
  consort::save_checkpoint(path("n.safetensors"), names, {});
  auto restored =
      consort::restore_nest(model(9.0f), consort::load_checkpoint(path("n.safetensors")));
  EXPECT_EQ(restored, params);
}

// -- the manager
// ---------------------------------------------------------------------------------------

TEST_F(CheckpointTest, TheManagerKeepsTheLastNAndRestoresTheNewest) {
  checkpoint_manager manager(path("run"), keeping(3));
  for (int64_t step : {10, 20, 30, 40, 50})
    manager.save(consort::named_leaves(model(static_cast<float>(step))), at_step(step));
  auto kept = manager.checkpoints();
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_EQ(fs::path(kept[0]).filename(), "ckpt-30.safetensors");
  EXPECT_EQ(fs::path(kept[2]).filename(), "ckpt-50.safetensors");
  auto latest = manager.restore_latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->data.metadata.step, 50);
  EXPECT_EQ(consort::restore_nest(model(), latest->data), model(50.0f));
}

TEST_F(CheckpointTest, StepsSortAsNumbersNotText) {
  checkpoint_manager manager(dir_, keeping(10));
  for (int64_t step : {9, 100, 11})
    manager.save(consort::named_leaves(model()), at_step(step));
  EXPECT_EQ(manager.restore_latest()->data.metadata.step, 100);
  ASSERT_EQ(manager.checkpoints().size(), 3u);
  EXPECT_EQ(fs::path(manager.checkpoints()[0]).filename(), "ckpt-9.safetensors");
}

TEST_F(CheckpointTest, AnEmptyDirectoryHasNoLatest) {
  checkpoint_manager manager(path("nothing/here"));
  EXPECT_TRUE(fs::is_directory(path("nothing/here")));
  EXPECT_FALSE(manager.restore_latest().has_value());
}

TEST_F(CheckpointTest, ACorruptNewestIsSkippedWithAWarningForThePreviousGoodOne) {
  std::vector<std::string> warnings;
  checkpoint_manager manager(dir_, warning_to(warnings));
  manager.save(consort::named_leaves(model(1.0f)), at_step(1));
  const std::string newest = manager.save(consort::named_leaves(model(2.0f)), at_step(2));
  std::string bytes = read_file(newest);
  bytes[data_offset_of(bytes, "dense/0") + 5] ^= 0x10;
  write_file(newest, bytes);
  auto latest = manager.restore_latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->data.metadata.step, 1);
  EXPECT_EQ(consort::restore_nest(model(), latest->data), model(1.0f));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("skipping checkpoint"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("ckpt-2.safetensors"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("\"dense/0\""), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("trying the one before"), std::string::npos) << warnings[0];
}

TEST_F(CheckpointTest, ATornNewestIsSkippedForThePreviousGoodOne) {
  std::vector<std::string> warnings;
  checkpoint_manager manager(dir_, warning_to(warnings));
  manager.save(consort::named_leaves(model(1.0f)), at_step(1));
  const std::string newest = manager.save(consort::named_leaves(model(2.0f)), at_step(2));
  fs::resize_file(newest, fs::file_size(newest) / 2);
  auto latest = manager.restore_latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->data.metadata.step, 1);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("truncated"), std::string::npos) << warnings[0];
}

TEST_F(CheckpointTest, TheManagerRemovesATemporaryFileAKilledWriterLeft) {
  checkpoint_manager manager(dir_);
  write_file(path(".ckpt-3.safetensors.tmp-99999-0"), "half a checkpoint");
  fs::last_write_time(path(".ckpt-3.safetensors.tmp-99999-0"),
                      fs::file_time_type::clock::now() - std::chrono::minutes(2));
  manager.save(consort::named_leaves(model()), at_step(4));
  EXPECT_EQ(files(), std::vector<std::string>{"ckpt-4.safetensors"});
}

// A replaced chief (stopped or cut off, then let go on) may still be finishing a save into the
// directory: the new chief's save leaves its temporary file, which is being written now.
TEST_F(CheckpointTest, TheManagerLeavesATemporaryFileAnotherWriterIsWritingNow) {
  checkpoint_manager manager(dir_);
  write_file(path(".ckpt-3.safetensors.tmp-99999-0"), "a checkpoint on its way");
  manager.save(consort::named_leaves(model()), at_step(4));
  EXPECT_EQ(files(),
            (std::vector<std::string>{".ckpt-3.safetensors.tmp-99999-0", "ckpt-4.safetensors"}));
}

TEST_F(CheckpointTest, TheManagerRefusesBadOptions) {
  EXPECT_TRUE(fails_with([&] { checkpoint_manager m(dir_, keeping(0)); }, errc::invalid_argument,
                         {"max_to_keep must be at least 1"}));
  EXPECT_TRUE(fails_with([&] { checkpoint_manager m(dir_, named("a/b")); }, errc::invalid_argument,
                         {"prefix", "\"a/b\""}));
  write_file(path("plain-file"), "x");
  EXPECT_TRUE(fails_with([&] { checkpoint_manager m(path("plain-file")); }, errc::io_error,
                         {"cannot create the directory", "plain-file"}));
  checkpoint_manager manager(dir_);
  EXPECT_TRUE(fails_with([&] { manager.save({}, at_step(-1)); }, errc::invalid_argument,
                         {"step must be >= 0", "-1"}));
}

// -- bad files
// ------------------------------------------------------------------------------------------

TEST_F(CheckpointTest, CorruptedTensorBytesFailNamingTheTensor) {
  consort::save_checkpoint(path("c.safetensors"), consort::named_leaves(model()), {});
  std::string bytes = read_file(path("c.safetensors"));
  bytes[data_offset_of(bytes, "dense/1")] ^= 0x01;
  write_file(path("c.safetensors"), bytes);
  EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("c.safetensors")); }, errc::data_loss,
                         {"c.safetensors", "tensor \"dense/1\"", "CRC32C", "corrupted"}));
}

TEST_F(CheckpointTest, ACorruptedHeaderFails) {
  consort::save_checkpoint(path("h.safetensors"), consort::named_leaves(model()), at_step(12));
  std::string bytes = read_file(path("h.safetensors"));
  // Still valid JSON, another step: only the header's checksum can tell.
  auto at = bytes.find("\"consort.step\":\"12\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at + std::string("\"consort.step\":\"1").size()] = '3';
  write_file(path("h.safetensors"), bytes);
  EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("h.safetensors")); }, errc::data_loss,
                         {"h.safetensors", "header", "corrupted"}));
  // Not JSON at all.
  bytes[8] = '#';
  write_file(path("h.safetensors"), bytes);
  EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("h.safetensors")); }, errc::data_loss,
                         {"not valid JSON"}));
}

TEST_F(CheckpointTest, ASafetensorsFileWithoutConsortsChecksumsIsRefused) {
  // What another writer (safetensors' own save_file) makes: the layout without the metadata that
  // lets consort verify the bytes.
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string file(8, '\0');
  const uint64_t length = header.size();
  std::memcpy(file.data(), &length, 8);
  file += header + std::string(8, '\0');
  write_file(path("foreign.safetensors"), file);
  EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("foreign.safetensors")); },
                         errc::data_loss,
                         {"foreign.safetensors", "no \"__metadata__\"", "consort checkpoint"}));
}

TEST_F(CheckpointTest, TruncatedFilesFailSayingSo) {
  consort::save_checkpoint(path("t.safetensors"), consort::named_leaves(model()), {});
  const std::string bytes = read_file(path("t.safetensors"));
  for (size_t size : {size_t{0}, size_t{5}, size_t{40}, bytes.size() - 1}) {
    write_file(path("t.safetensors"), bytes.substr(0, size));
    EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("t.safetensors")); },
                           errc::data_loss, {"t.safetensors", "truncated"}))
        << size << " bytes";
  }
  write_file(path("t.safetensors"), bytes + "extra");
  EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("t.safetensors")); }, errc::data_loss,
                         {"trailing bytes"}));
}

TEST_F(CheckpointTest, AMissingFileIsAnIoError) {
  EXPECT_TRUE(fails_with([&] { consort::load_checkpoint(path("none.safetensors")); },
                         errc::io_error, {"open", "none.safetensors", "No such file"}));
}

TEST_F(CheckpointTest, AnotherModelShapeOrDtypeFailsNamingTheTensor) {
  consort::save_checkpoint(path("a.safetensors"), consort::named_leaves(model(0.5f, 3)), {});
  auto data = consort::load_checkpoint(path("a.safetensors"));
  EXPECT_TRUE(fails_with([&] { consort::restore_nest(model(0.5f, 5), data); }, errc::shape_mismatch,
                         {"tensor \"dense/0\"", "expected shape [5, 4]", "holds [3, 4]"}));
  nest as_doubles = nest::dict({{"dense", nest::list({tensor::zeros(dtype::float64, {3, 4}),
                                                      tensor::zeros(dtype::float32, {4})})},
                                {"step_count", tensor::scalar<int64_t>(0)}});
  EXPECT_TRUE(fails_with([&] { consort::restore_nest(as_doubles, data); }, errc::dtype_mismatch,
                         {"tensor \"dense/0\"", "expected float64[3, 4]", "holds float32[3, 4]"}));
}

TEST_F(CheckpointTest, AMissingTensorFailsNamingItAndWhatIsThere) {
  consort::save_checkpoint(path("m.safetensors"), consort::named_leaves(model()), {});
  auto data = consort::load_checkpoint(path("m.safetensors"));
  nest bigger = nest::dict({{"dense", model()["dense"]},
                            {"step_count", tensor::scalar<int64_t>(0)},
                            {"extra", tensor::zeros(dtype::float32, {2})}});
  EXPECT_TRUE(fails_with([&] { consort::restore_nest(bigger, data); }, errc::structure_mismatch,
                         {"no tensor \"extra\"", "float32[2]", "\"dense/0\""}));
}

TEST_F(CheckpointTest, BadNamesAreRefusedBeforeAnythingIsWritten) {
  const tensor t = tensor::scalar<float>(1);
  EXPECT_TRUE(fails_with(
      [&] {
        consort::save_checkpoint(path("x"), {{"", t}}, {});
      },
      errc::invalid_argument, {"non-empty"}));
  EXPECT_TRUE(fails_with(
      [&] {
        consort::save_checkpoint(path("x"), {{"__metadata__", t}}, {});
      },
      errc::invalid_argument, {"__metadata__"}));
  EXPECT_TRUE(fails_with(
      [&] {
        consort::save_checkpoint(path("x"), {{"a", t}, {"a", t}}, {});
      },
      errc::invalid_argument, {"two tensors are named \"a\""}));
  EXPECT_TRUE(fails_with(
      [&] {
        consort::save_checkpoint(path("x"), {{"a", tensor{}}}, {});
      },
      errc::invalid_argument, {"placeholder"}));
  EXPECT_TRUE(fails_with(
      [&] {
        consort::named_leaves(nest::dict({{"a/0", t}, {"a", nest::list({t})}}));
      },
      errc::invalid_argument, {"two leaves are named \"a/0\""}));
  EXPECT_TRUE(files().empty());
}

// -- full disks
// -------------------------------------------------------------------------------------------

TEST_F(CheckpointTest, AFullDiskLeavesThePreviousCheckpointAndNoTemporaryFile) {
  checkpoint_manager manager(dir_);
  const std::string first = manager.save(consort::named_leaves(model(1.0f)), at_step(1));
  const std::string before = read_file(first);
  // The writer's next writes fail as a full disk's do, part-way through the data; then a save
  // of the same step (which would replace the file) and of a new one.
  for (int64_t step : {1, 2}) {
    consort::detail::checkpoint_fail_writes_after(100, ENOSPC);
    EXPECT_TRUE(fails_with([&] { manager.save(consort::named_leaves(model(2.0f)), at_step(step)); },
                           errc::io_error,
                           {"write", "No space left on device", "after 100 bytes"}));
    consort::detail::checkpoint_clear_write_fault();
    EXPECT_EQ(files(), std::vector<std::string>{"ckpt-1.safetensors"}) << "step " << step;
  }
  EXPECT_EQ(read_file(first), before);
  auto latest = manager.restore_latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(consort::restore_nest(model(), latest->data), model(1.0f));
}

TEST_F(CheckpointTest, AWriterKilledPartWayLeavesItsTemporaryFileAndThePreviousCheckpoint) {
  checkpoint_manager manager(dir_);
  manager.save(consort::named_leaves(model(1.0f)), at_step(1));
  bool killed = false;
  consort::detail::checkpoint_kill_writes_after(100, [&] { killed = true; });
  EXPECT_TRUE(fails_with([&] { manager.save(consort::named_leaves(model(2.0f)), at_step(2)); },
                         errc::peer_lost, {"ckpt-2.safetensors.tmp-", "killed after 100 bytes"}));
  EXPECT_TRUE(killed);
  // What the dead writer left: its temporary file, 100 bytes of it, and the checkpoint before.
  auto left = files();
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[1], "ckpt-1.safetensors");
  EXPECT_EQ(left[0].rfind(".ckpt-2.safetensors.tmp-", 0), 0u) << left[0];
  EXPECT_EQ(fs::file_size(path(left[0])), 100u);
  auto latest = manager.restore_latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(consort::restore_nest(model(), latest->data), model(1.0f));
  // Once: the next save is whole; once the dead writer's file is old, a save removes it.
  fs::last_write_time(path(left[0]), fs::file_time_type::clock::now() - std::chrono::minutes(2));
  manager.save(consort::named_leaves(model(3.0f)), at_step(3));
  EXPECT_EQ(files(), (std::vector<std::string>{"ckpt-1.safetensors", "ckpt-3.safetensors"}));
}

TEST_F(CheckpointTest, TheKernelsFileSizeLimitFailsTheWriteAndLeavesNothingBehind) {
  // The same as a full disk, from the kernel itself: RLIMIT_FSIZE makes a write past the limit
  // fail (EFBIG once SIGXFSZ is ignored). It binds root too.
  consort::save_checkpoint(path("good.safetensors"), consort::named_leaves(model(1.0f)), {});
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit tight = old;
  tight.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &tight), 0);
  const bool failed = fails_with(
      [&] {
        consort::save_checkpoint(path("good.safetensors"), consort::named_leaves(model(2.0f)), {});
      },
      errc::io_error, {"write", "File too large"});
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(failed);
  EXPECT_EQ(files(), std::vector<std::string>{"good.safetensors"});
  EXPECT_EQ(consort::restore_nest(model(), consort::load_checkpoint(path("good.safetensors"))),
            model(1.0f));
}

TEST_F(CheckpointTest, AMissingDirectoryIsAnIoErrorNamingIt) {
  EXPECT_TRUE(
      fails_with([&] { consort::save_checkpoint(path("no/such/dir/c.safetensors"), {}, {}); },
                 errc::io_error, {"open", "no/such/dir", "No such file or directory"}));
}

// -- other readers
// --------------------------------------------------------------------------------------

namespace {

/// The elements of `t` as doubles (bfloat16 and float16 widened exactly).
std::vector<double> as_doubles(const tensor& t) {
  std::vector<double> out;
  auto add = [&](auto values) {
    for (auto v : values)
      out.push_back(static_cast<double>(v));
  };
  switch (t.dtype()) {
  case dtype::float32:
    add(t.to_vector<float>());
    break;
  case dtype::float64:
    add(t.to_vector<double>());
    break;
  case dtype::int32:
    add(t.to_vector<int32_t>());
    break;
  case dtype::int64:
    add(t.to_vector<int64_t>());
    break;
  case dtype::uint8:
    add(t.to_vector<uint8_t>());
    break;
  case dtype::boolean:
    add(t.to_vector<bool>());
    break;
  case dtype::float16:
    for (auto v : t.to_vector<float16_t>())
      out.push_back(static_cast<double>(static_cast<float>(v)));
    break;
  case dtype::bfloat16:
    for (auto v : t.to_vector<bfloat16_t>())
      out.push_back(static_cast<double>(static_cast<float>(v)));
    break;
  }
  return out;
}

} // namespace

TEST_F(CheckpointTest, ATenLineNumpyReaderLoadsTheValues) {
  const std::string python = CONSORT_TEST_NUMPY_PYTHON;
  if (python.empty())
    GTEST_SKIP() << "no python3 with numpy was found when the build was configured (tools/setup.sh "
                    "installs python3-numpy)";
  // int64 values stay within 2^53 so that the comparison through double is exact.
  std::vector<named_tensor> tensors = {
      {"f32", tensor::from(std::vector<float>{1.5f, -0.0f, 3.25e-39f, 1e30f, -7.0f, 0.1f}, {2, 3})},
      {"f64", tensor::from(std::vector<double>{3.141592653589793, -2.5e-300}, {2})},
      {"i32", tensor::from(std::vector<int32_t>{-2147483647 - 1, 0, 2147483647}, {3, 1})},
      {"i64", tensor::from(std::vector<int64_t>{-(int64_t{1} << 53), -1, int64_t{1} << 52}, {3})},
      {"u8", tensor::from(std::vector<uint8_t>{0, 127, 255}, {1, 3})},
      {"bool", tensor::from(std::vector<bool>{true, false, true, true}, {2, 2})},
      {"f16", tensor::from(std::vector<float16_t>{float16_t{1.0f}, float16_t{-65504.0f},
                                                  float16_t::from_bits(0x0001)},
                           {3})},
      {"bf16", tensor::from(std::vector<bfloat16_t>{bfloat16_t{1.0f}, bfloat16_t{-3.0e38f}}, {2})},
      {"scalar", tensor::scalar<float>(42.0f)},
  };
  consort::save_checkpoint(path("py.safetensors"), tensors, at_step(77));
  const std::string command = "timeout 60 \"" + python +
                              "\" \"" CONSORT_TEST_CHECKPOINT_READER "\" \"" +
                              path("py.safetensors") + "\" 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe))
    output.append(buffer, n);
  ASSERT_EQ(::pclose(pipe), 0) << command << "\n" << output;

  std::istringstream lines(output);
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(line, "step 77");
  size_t seen = 0;
  while (std::getline(lines, line)) {
    // name dtype [shape] values...
    std::istringstream fields(line);
    std::string name, type;
    fields >> name >> type;
    const tensor* want = nullptr;
    for (const auto& t : tensors)
      if (t.name == name)
        want = &t.value;
    ASSERT_NE(want, nullptr) << line;
    ++seen;
    const std::string rest = line.substr(line.find('['));
    const std::string shape = rest.substr(0, rest.find(']') + 1);
    EXPECT_EQ(shape, consort::to_string(want->shape())) << line;
    std::istringstream values(rest.substr(shape.size()));
    std::vector<double> got;
    for (std::string v; values >> v;)
      got.push_back(std::strtod(v.c_str(), nullptr));
    const auto expected = as_doubles(*want);
    ASSERT_EQ(got.size(), expected.size()) << line;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], expected[i]) << name << "[" << i << "] in " << line;
      EXPECT_EQ(std::signbit(got[i]), std::signbit(expected[i])) << name << "[" << i << "]";
    }
  }
  EXPECT_EQ(seen, tensors.size()) << output;
}
