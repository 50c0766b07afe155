#pragma once

// A test seam of the checkpoint writer (device/checkpoint.cpp), not installed: makes its writes
// fail as a full disk does, so that a test can check that a failed save leaves the previous
// checkpoint usable and no temporary file behind, without filling a real disk; or stop as a
// killed writer does, part-way through, leaving its temporary file.

#include <consort/error.hpp>

#include <cstddef>
#include <functional>

namespace consort::detail {

/// From now on, a checkpoint write that would take the file past `bytes` fails with `error_number`
/// (for example ENOSPC) after writing up to `bytes`; the writes before succeed.
/// Thread safety: process-wide; for tests that save from one thread.
void checkpoint_fail_writes_after(size_t bytes, int error_number);

/// Undoes `checkpoint_fail_writes_after` and `checkpoint_kill_writes_after`.
void checkpoint_clear_write_fault();

/// What a save throws when `checkpoint_kill_writes_after` stopped it: the writer is dead, so it
/// leaves its temporary file as it is (a killed process removes nothing).
class checkpoint_writer_killed : public error {
public:
  using error::error;
};

/// Once: the next checkpoint write that would take a file past `bytes` writes up to `bytes`,
/// calls `killed` (the test kills the writer there: consort::testing::cluster::kill), and throws
/// checkpoint_writer_killed (errc peer_lost). Thread safety: process-wide; for tests in which one
/// thread saves at a time.
void checkpoint_kill_writes_after(size_t bytes, std::function<void()> killed);

} // namespace consort::detail
