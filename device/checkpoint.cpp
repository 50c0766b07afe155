// Checkpoint files (include/consort/checkpoint.hpp) in safetensors' layout; docs/checkpoints.md
// describes the format.

#include <consort/checkpoint.hpp>

#include "device/checkpoint_seam.hpp"

#include <consort/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <utility>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace consort {

// The file holds little-endian numbers and tensors are written from their host bytes as they are.
static_assert(std::endian::native == std::endian::little,
              "checkpoint files are little-endian; a big-endian host would need byte swaps");

namespace {

using json = nlohmann::json;

constexpr const char* metadata_key = "__metadata__";
constexpr const char* checksum_prefix = "consort.crc32c.";
constexpr const char* header_checksum_key = "consort.header_crc32c";
constexpr const char* user_prefix = "user.";
constexpr const char* format_version = "1";
// A header longer than this is taken for garbage rather than allocated.
constexpr uint64_t max_header_bytes = uint64_t{1} << 30;

// -- CRC32C (Castagnoli), software and SSE4.2 ----------------------------------------------------

struct crc_table {
  uint32_t entries[8][256];
  constexpr crc_table() : entries{} {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = (c & 1u) != 0 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      entries[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int t = 1; t < 8; ++t)
        entries[t][i] = (entries[t - 1][i] >> 8) ^ entries[0][entries[t - 1][i] & 0xffu];
  }
};
constexpr crc_table crc_tables{};

uint32_t crc32c_software(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = crc_tables.entries;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^
          t[4][(word >> 24) & 0xff] ^ t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^
          t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0)
    crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xffu];
  return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p,
                                                        size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<uint32_t>(c);
  while (n-- > 0)
    c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

bool have_sse42() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return yes;
}
#endif

/// CRC32C of `n` bytes, continuing `crc` (0 to start).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (have_sse42())
    return ~crc32c_sse42(crc, p, n);
#endif
  return ~crc32c_software(crc, p, n);
}

std::string hex32(uint32_t v) {
  char out[9];
  std::snprintf(out, sizeof out, "%08x", v);
  return out;
}

std::string to_hex(const std::string& bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

// -- dtypes
// ----------------------------------------------------------------------------------------

/// Safetensors' dtype names.
const char* safetensors_name(dtype t) {
  switch (t) {
  case dtype::float32:
    return "F32";
  case dtype::float64:
    return "F64";
  case dtype::int32:
    return "I32";
  case dtype::int64:
    return "I64";
  case dtype::uint8:
    return "U8";
  case dtype::boolean:
    return "BOOL";
  case dtype::float16:
    return "F16";
  case dtype::bfloat16:
    return "BF16";
  }
  return "?";
}

std::optional<dtype> dtype_of_name(const std::string& name) {
  for (auto t : {dtype::float32, dtype::float64, dtype::int32, dtype::int64, dtype::uint8,
                 dtype::boolean, dtype::float16, dtype::bfloat16})
    if (name == safetensors_name(t))
      return t;
  return std::nullopt;
}

// -- file descriptors
// -------------------------------------------------------------------------------

std::string system_reason(int error_number) {
  return std::strerror(error_number) + std::string{" (errno "} + std::to_string(error_number) + ")";
}

[[noreturn]] void io_failure(const std::string& call, const std::string& path, int error_number,
                             const std::string& context = {}) {
  throw_error(errc::io_error, "checkpoint: " + call + " of \"" + path + "\" failed" + context +
                                  ": " + system_reason(error_number));
}

/// Closes a descriptor when the scope ends (a close that matters is checked before).
struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0)
      ::close(fd);
  }
};

// The seam of device/checkpoint_seam.hpp: writes past fault_after fail with fault_errno.
std::atomic<size_t> fault_after{std::numeric_limits<size_t>::max()};
std::atomic<int> fault_errno{0};
// The kill of checkpoint_kill_writes_after (set with fault_after; taken once).
std::mutex fault_mtx;
std::function<void()> fault_killed;

/// Writes all `n` bytes at the file's position `written` (counted for the seam).
void write_all(int fd, const void* data, size_t n, size_t& written, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    const size_t limit = fault_after.load(std::memory_order_relaxed);
    if (written + chunk > limit) {
      if (written >= limit) {
        std::function<void()> killed;
        {
          std::lock_guard<std::mutex> guard{fault_mtx};
          killed = std::exchange(fault_killed, nullptr);
          if (killed)
            fault_after.store(std::numeric_limits<size_t>::max());
        }
        if (killed) {
          killed();
          throw detail::checkpoint_writer_killed(
              errc::peer_lost, "checkpoint: the writer of \"" + path + "\" was killed after " +
                                   std::to_string(written) + " bytes (by the test seam)");
        }
        io_failure("write", path, fault_errno.load(),
                   " after " + std::to_string(written) + " bytes");
      }
      chunk = limit - written;
    }
    ssize_t got = ::write(fd, p, chunk);
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0)
      io_failure("write", path, errno, " after " + std::to_string(written) + " bytes");
    p += got;
    n -= static_cast<size_t>(got);
    written += static_cast<size_t>(got);
  }
}

/// Reads exactly `n` bytes at `offset`; false at the end of the file before that.
bool read_at(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t got = ::pread(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0)
      io_failure("read", path, errno, " at byte " + std::to_string(offset));
    if (got == 0)
      return false;
    p += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return true;
}

std::string parent_of(const std::string& path) {
  auto parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

void fsync_directory(const std::string& dir) {
  fd_guard d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (d.fd < 0)
    io_failure("open (to fsync the directory)", dir, errno);
  if (::fsync(d.fd) != 0 && errno != EINVAL) // some file systems cannot sync a directory
    io_failure("fsync", dir, errno);
}

// -- the header
// ---------------------------------------------------------------------------------------

void check_names(const std::vector<named_tensor>& tensors) {
  std::set<std::string> seen;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == metadata_key)
      throw_error(
          errc::invalid_argument,
          "save_checkpoint: a tensor name must be non-empty and not \"__metadata__\"; got \"" +
              t.name + "\"");
    if (!t.value.valid())
      throw_error(errc::invalid_argument, "save_checkpoint: tensor \"" + t.name +
                                              "\" is a default-constructed placeholder");
    if (!seen.insert(t.name).second)
      throw_error(errc::invalid_argument, "save_checkpoint: two tensors are named \"" + t.name +
                                              "\"; names must be unique");
  }
}

json metadata_json(const checkpoint_metadata& m) {
  json out = json::object();
  out["consort.format"] = format_version;
  out["consort.step"] = std::to_string(m.step);
  out["consort.dataset_position"] = std::to_string(m.dataset_position);
  out["consort.rng_state"] = to_hex(m.rng_state);
  out["consort.num_workers"] = std::to_string(m.num_workers);
  out["consort.num_replicas_in_sync"] = std::to_string(m.num_replicas_in_sync);
  for (const auto& [key, value] : m.user)
    out[user_prefix + key] = value;
  return out;
}

/// The header's text, padded with spaces to a multiple of 8 bytes (as safetensors pads it) so that
/// the data starts aligned. The header's own checksum covers its dump without that entry.
std::string header_text(const std::vector<named_tensor>& host, const checkpoint_metadata& m) {
  json header = json::object();
  json meta = metadata_json(m);
  uint64_t offset = 0;
  for (const auto& t : host) {
    const uint64_t bytes = t.value.num_bytes();
    header[t.name] = {{"dtype", safetensors_name(t.value.dtype())},
                      {"shape", t.value.shape()},
                      {"data_offsets", {offset, offset + bytes}}};
    meta[checksum_prefix + t.name] = hex32(crc32c(t.value.raw_data(), bytes));
    offset += bytes;
  }
  header[metadata_key] = meta;
  std::string text;
  try {
    const std::string unsealed = header.dump();
    header[metadata_key][header_checksum_key] = hex32(crc32c(unsealed.data(), unsealed.size()));
    text = header.dump();
  } catch (const json::exception& e) {
    throw_error(errc::invalid_argument, "save_checkpoint: the tensor names and metadata must be "
                                        "UTF-8 text (" +
                                            std::string{e.what()} + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

} // namespace

// -- test seam
// ---------------------------------------------------------------------------------------

namespace detail {

void checkpoint_fail_writes_after(size_t bytes, int error_number) {
  fault_errno.store(error_number);
  fault_after.store(bytes);
}

void checkpoint_clear_write_fault() {
  std::lock_guard<std::mutex> guard{fault_mtx};
  fault_killed = nullptr;
  fault_after.store(std::numeric_limits<size_t>::max());
}

void checkpoint_kill_writes_after(size_t bytes, std::function<void()> killed) {
  std::lock_guard<std::mutex> guard{fault_mtx};
  fault_killed = std::move(killed);
  fault_after.store(bytes);
}

} // namespace detail

// -- names
// --------------------------------------------------------------------------------------------

const tensor* checkpoint_data::find(const std::string& name) const noexcept {
  for (const auto& t : tensors)
    if (t.name == name)
      return &t.value;
  return nullptr;
}

namespace {

void collect_leaves(const nest& value, const std::string& path, std::vector<named_tensor>& out) {
  auto child = [&](const std::string& part) {
    return path.empty() ? part : path + "/" + part;
  };
  if (value.is_tensor()) {
    out.push_back({path.empty() ? "value" : path, value.as_tensor()});
  } else if (value.is_list()) {
    const auto& items = value.as_list();
    for (size_t i = 0; i < items.size(); ++i)
      collect_leaves(items[i], child(std::to_string(i)), out);
  } else {
    for (const auto& [key, item] : value.as_dict())
      collect_leaves(item, child(key), out);
  }
}

} // namespace

std::vector<named_tensor> named_leaves(const nest& value) {
  std::vector<named_tensor> out;
  collect_leaves(value, "", out);
  std::set<std::string> seen;
  for (const auto& t : out)
    if (!seen.insert(t.name).second)
      throw_error(errc::invalid_argument,
                  "named_leaves: two leaves are named \"" + t.name +
                      "\" (a dict key containing \"/\" or a number); expected distinct paths");
  return out;
}

// -- save
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, const std::vector<named_tensor>& tensors,
                     const checkpoint_metadata& metadata) {
  check_names(tensors);
  std::vector<named_tensor> host;
  host.reserve(tensors.size());
  for (const auto& t : tensors)
    host.push_back({t.name, t.value.on_gpu() ? t.value.to("CPU:0") : t.value});
  const std::string header = header_text(host, metadata);

  // A name no other writer of this directory uses: this process and a counter.
  static std::atomic<uint64_t> counter{0};
  const std::string dir = parent_of(path);
  const std::string temp = dir + "/." + std::filesystem::path(path).filename().string() + ".tmp-" +
                           std::to_string(::getpid()) + "-" + std::to_string(counter++);
  fd_guard file{::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
  if (file.fd < 0)
    io_failure("open", temp, errno, " (the temporary file of a checkpoint)");
  try {
    size_t written = 0;
    const uint64_t length = header.size();
    write_all(file.fd, &length, 8, written, temp);
    write_all(file.fd, header.data(), header.size(), written, temp);
    for (const auto& t : host)
      write_all(file.fd, t.value.raw_data(), t.value.num_bytes(), written, temp);
    if (::fsync(file.fd) != 0)
      io_failure("fsync", temp, errno);
    const int fd = file.fd;
    file.fd = -1;
    if (::close(fd) != 0)
      io_failure("close", temp, errno);
    if (::rename(temp.c_str(), path.c_str()) != 0)
      io_failure("rename", temp, errno, " to \"" + path + "\"");
  } catch (const detail::checkpoint_writer_killed&) {
    throw; // a dead writer removes nothing
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  // The rename is durable once the directory is.
  fsync_directory(dir);
}

// -- load
// ---------------------------------------------------------------------------------------------

namespace {

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw_error(errc::data_loss, "checkpoint \"" + path + "\": " + what);
}

int64_t metadata_int(const json& meta, const std::string& key, const std::string& path) {
  auto it = meta.find(key);
  if (it == meta.end())
    corrupt(path, "the metadata lacks \"" + key + "\"; expected a consort checkpoint");
  const std::string text = it->get<std::string>();
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size())
    corrupt(path, "metadata \"" + key + "\" is \"" + text + "\"; expected an integer");
  return v;
}

std::string from_hex(const std::string& hex, const std::string& path) {
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9')
      return c - '0';
    if (c >= 'a' && c <= 'f')
      return c - 'a' + 10;
    corrupt(path, "metadata \"consort.rng_state\" is not hex");
  };
  if (hex.size() % 2 != 0)
    corrupt(path, "metadata \"consort.rng_state\" has an odd number of hex digits");
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2)
    out += static_cast<char>(digit(hex[i]) * 16 + digit(hex[i + 1]));
  return out;
}

/// Parses and checks the metadata: every value a string, the header's checksum, the consort keys.
checkpoint_metadata parse_metadata(json& header, const std::string& path) {
  if (!header.contains(metadata_key) || !header[metadata_key].is_object())
    corrupt(path, "the header has no \"__metadata__\" object; expected a consort checkpoint");
  json& meta = header[metadata_key];
  for (const auto& [key, value] : meta.items())
    if (!value.is_string())
      corrupt(path, "metadata \"" + key + "\" is not a string");
  if (!meta.contains(header_checksum_key))
    corrupt(path, "the metadata lacks \"" + std::string{header_checksum_key} + "\"");
  const std::string stored = meta[header_checksum_key].get<std::string>();
  meta.erase(header_checksum_key);
  const std::string dump = header.dump();
  if (hex32(crc32c(dump.data(), dump.size())) != stored)
    corrupt(path, "the header's CRC32C is " + hex32(crc32c(dump.data(), dump.size())) +
                      ", the header says " + stored + ": the header is corrupted");
  checkpoint_metadata m;
  m.step = metadata_int(meta, "consort.step", path);
  m.dataset_position = metadata_int(meta, "consort.dataset_position", path);
  m.num_workers = static_cast<int>(metadata_int(meta, "consort.num_workers", path));
  m.num_replicas_in_sync =
      static_cast<int>(metadata_int(meta, "consort.num_replicas_in_sync", path));
  m.rng_state = from_hex(meta.value("consort.rng_state", std::string{}), path);
  const std::string prefix = user_prefix;
  for (const auto& [key, value] : meta.items())
    if (key.compare(0, prefix.size(), prefix) == 0)
      m.user[key.substr(prefix.size())] = value.get<std::string>();
  return m;
}

struct entry {
  std::string name;
  dtype type;
  shape_t shape;
  uint64_t begin;
  uint64_t end;
};

/// The tensor entries of the header, checked, by data offset.
std::vector<entry> parse_entries(const json& header, const std::string& path) {
  std::vector<entry> out;
  for (const auto& [name, value] : header.items()) {
    if (name == metadata_key)
      continue;
    const std::string what = "tensor \"" + name + "\"";
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets") || !value["dtype"].is_string() ||
        !value["shape"].is_array() || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2)
      corrupt(path, what + ": expected {\"dtype\", \"shape\", \"data_offsets\": [begin, end]}");
    auto type = dtype_of_name(value["dtype"].get<std::string>());
    if (!type)
      corrupt(path, what + " has dtype \"" + value["dtype"].get<std::string>() +
                        "\"; expected one of F32, F64, I32, I64, U8, BOOL, F16, BF16");
    entry e{name, *type, {}, 0, 0};
    for (const auto& extent : value["shape"]) {
      if (!extent.is_number_unsigned())
        corrupt(path, what + ": its shape " + value["shape"].dump() +
                          " is not a list of non-negative integers");
      e.shape.push_back(extent.get<int64_t>());
    }
    for (const auto& offset : value["data_offsets"])
      if (!offset.is_number_unsigned())
        corrupt(path, what + ": data_offsets are not non-negative integers");
    e.begin = value["data_offsets"][0].get<uint64_t>();
    e.end = value["data_offsets"][1].get<uint64_t>();
    // The element count in unsigned arithmetic, refusing overflow: a wrong shape must fail here,
    // not in an allocation.
    uint64_t bytes = size_of(e.type);
    for (int64_t extent : e.shape)
      if (extent < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes))
        corrupt(path, what + ": its shape " + value["shape"].dump() + " is too large");
    if (e.end < e.begin || e.end - e.begin != bytes)
      corrupt(path, what + ", " + to_string(e.type) + to_string(e.shape) + ", needs " +
                        std::to_string(bytes) + " bytes; its data_offsets [" +
                        std::to_string(e.begin) + ", " + std::to_string(e.end) + "] hold " +
                        std::to_string(e.end - e.begin));
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(),
            [](const entry& a, const entry& b) { return a.begin < b.begin; });
  uint64_t expected = 0;
  for (const auto& e : out) {
    if (e.begin != expected)
      corrupt(path, "tensor \"" + e.name + "\" starts at data byte " + std::to_string(e.begin) +
                        "; expected " + std::to_string(expected) + " (no gaps or overlaps)");
    expected = e.end;
  }
  return out;
}

} // namespace

checkpoint_data load_checkpoint(const std::string& path) {
  fd_guard file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0)
    io_failure("open", path, errno);
  struct stat st {};
  if (::fstat(file.fd, &st) != 0)
    io_failure("fstat", path, errno);
  const auto size = static_cast<uint64_t>(st.st_size);
  uint64_t length = 0;
  if (size < 8 || !read_at(file.fd, &length, 8, 0, path))
    corrupt(path, "the file has " + std::to_string(size) +
                      " bytes; a checkpoint starts with an 8-byte header length (truncated?)");
  if (length > max_header_bytes || length > size - 8)
    corrupt(path, "the header length is " + std::to_string(length) + " bytes but the file has " +
                      std::to_string(size - 8) + " after it (truncated or not a checkpoint)");
  std::string text(length, '\0');
  if (!read_at(file.fd, text.data(), length, 8, path))
    corrupt(path, "the file ended inside its header (truncated)");
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    corrupt(path, "the header is not valid JSON (" + std::string{e.what()} + ")");
  }
  if (!header.is_object())
    corrupt(path, "the header is not a JSON object");
  checkpoint_data out;
  out.metadata = parse_metadata(header, path);
  const auto entries = parse_entries(header, path);
  const uint64_t data_start = 8 + length;
  const uint64_t data_bytes = entries.empty() ? 0 : entries.back().end;
  if (size != data_start + data_bytes)
    corrupt(path, "the file has " + std::to_string(size) + " bytes; its header describes " +
                      std::to_string(data_start + data_bytes) +
                      (size < data_start + data_bytes ? " (truncated)" : " (trailing bytes)"));
  const json& meta = header[metadata_key];
  for (const auto& e : entries) {
    auto it = meta.find(checksum_prefix + e.name);
    if (it == meta.end())
      corrupt(path, "tensor \"" + e.name + "\" has no checksum (\"" + checksum_prefix + e.name +
                        "\" in the metadata)");
    tensor t = tensor::empty(e.type, e.shape);
    if (!read_at(file.fd, t.raw_mutable_data(), t.num_bytes(), data_start + e.begin, path))
      corrupt(path, "the file ended inside tensor \"" + e.name + "\" (truncated)");
    const std::string found = hex32(crc32c(t.raw_data(), t.num_bytes()));
    if (found != it->get<std::string>())
      corrupt(path, "tensor \"" + e.name + "\": the CRC32C of its " +
                        std::to_string(t.num_bytes()) + " bytes is " + found +
                        ", the header says " + it->get<std::string>() + ": its data is corrupted");
    out.tensors.push_back({e.name, std::move(t)});
  }
  return out;
}

// -- restore
// ------------------------------------------------------------------------------------------

std::vector<named_tensor> restore_tensors(const std::vector<named_tensor>& expected,
                                          const checkpoint_data& data) {
  std::vector<named_tensor> out;
  out.reserve(expected.size());
  for (const auto& want : expected) {
    const tensor* found = data.find(want.name);
    if (found == nullptr) {
      std::string names;
      for (size_t i = 0; i < data.tensors.size() && i < 10; ++i)
        names += (i > 0 ? ", \"" : "\"") + data.tensors[i].name + "\"";
      if (data.tensors.size() > 10)
        names += ", ...";
      throw_error(errc::structure_mismatch,
                  "restore: the checkpoint has no tensor \"" + want.name + "\" (expected " +
                      to_string(want.value.dtype()) + to_string(want.value.shape()) + "); it has " +
                      std::to_string(data.tensors.size()) + " tensor(s): " + names);
    }
    if (found->dtype() != want.value.dtype())
      throw_error(errc::dtype_mismatch, "restore: tensor \"" + want.name + "\": expected " +
                                            to_string(want.value.dtype()) +
                                            to_string(want.value.shape()) +
                                            ", the checkpoint holds " + to_string(found->dtype()) +
                                            to_string(found->shape()));
    if (found->shape() != want.value.shape())
      throw_error(errc::shape_mismatch, "restore: tensor \"" + want.name + "\": expected shape " +
                                            to_string(want.value.shape()) +
                                            ", the checkpoint holds " + to_string(found->shape()) +
                                            " (a checkpoint of another model?)");
    out.push_back({want.name, *found});
  }
  return out;
}

nest restore_nest(const nest& like, const checkpoint_data& data) {
  auto restored = restore_tensors(named_leaves(like), data);
  std::vector<tensor> leaves;
  leaves.reserve(restored.size());
  for (auto& t : restored)
    leaves.push_back(std::move(t.value));
  return pack_as(like, leaves);
}

// -- manager
// ------------------------------------------------------------------------------------------

checkpoint_manager::checkpoint_manager(std::string directory, checkpoint_manager_options options)
    : directory_(std::move(directory)), options_(std::move(options)) {
  if (options_.max_to_keep == 0)
    throw_error(errc::invalid_argument, "checkpoint_manager: max_to_keep must be at least 1");
  if (options_.prefix.empty() || options_.prefix.find('/') != std::string::npos)
    throw_error(errc::invalid_argument, "checkpoint_manager: the prefix must be a non-empty file "
                                        "name without \"/\"; got \"" +
                                            options_.prefix + "\"");
  if (directory_.empty())
    throw_error(errc::invalid_argument, "checkpoint_manager: the directory name is empty");
  std::error_code ec;
  std::filesystem::create_directories(directory_, ec);
  if (ec || !std::filesystem::is_directory(directory_))
    throw_error(errc::io_error, "checkpoint_manager: cannot create the directory \"" + directory_ +
                                    "\": " + (ec ? ec.message() : "a file of that name is there"));
}

std::vector<std::string> checkpoint_manager::checkpoints() const {
  const std::string head = options_.prefix + "-";
  const std::string tail = ".safetensors";
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& item : std::filesystem::directory_iterator(directory_, ec)) {
    const std::string name = item.path().filename().string();
    if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
      continue;
    const char* first = name.data() + head.size();
    const char* last = name.data() + name.size() - tail.size();
    int64_t step = 0;
    auto [end, err] = std::from_chars(first, last, step);
    if (err == std::errc{} && end == last && step >= 0)
      found.emplace_back(step, item.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, path] : found)
    out.push_back(std::move(path));
  return out;
}

std::string checkpoint_manager::save(const std::vector<named_tensor>& tensors,
                                     const checkpoint_metadata& metadata) {
  if (metadata.step < 0)
    throw_error(errc::invalid_argument, "checkpoint_manager::save: the step must be >= 0; got " +
                                            std::to_string(metadata.step));
  const std::string path =
      directory_ + "/" + options_.prefix + "-" + std::to_string(metadata.step) + ".safetensors";
  save_checkpoint(path, tensors, metadata);
  auto all = checkpoints();
  for (size_t i = 0; i + options_.max_to_keep < all.size(); ++i)
    ::unlink(all[i].c_str());
  // Temporary files of a writer that was killed mid-write: those untouched for a minute. One
  // writer per directory is the rule, but a chief that was stopped or cut off, and replaced,
  // may still be finishing a save; its file is being written now, so it is recent, and is left
  // to it.
  const std::string temp_head = "." + options_.prefix + "-";
  const auto stale_before = std::filesystem::file_time_type::clock::now() - std::chrono::minutes(1);
  std::error_code ec;
  for (const auto& item : std::filesystem::directory_iterator(directory_, ec)) {
    const std::string name = item.path().filename().string();
    if (name.compare(0, temp_head.size(), temp_head) != 0 ||
        name.find(".safetensors.tmp-") == std::string::npos)
      continue;
    std::error_code time_ec;
    const auto written = std::filesystem::last_write_time(item.path(), time_ec);
    if (!time_ec && written < stale_before)
      std::filesystem::remove(item.path(), ec);
  }
  return path;
}

std::optional<loaded_checkpoint> checkpoint_manager::restore_latest() const {
  auto all = checkpoints();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      return loaded_checkpoint{*it, load_checkpoint(*it)};
    } catch (const error& e) {
      const std::string line =
          "consort: skipping checkpoint \"" + *it + "\" (" + consort::to_string(e.code()) +
          "): " + e.what() +
          (std::next(it) != all.rend() ? "; trying the one before" : "; no older checkpoint");
      if (options_.on_warning)
        options_.on_warning(line);
      else
        std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
  return std::nullopt;
}

} // namespace consort
