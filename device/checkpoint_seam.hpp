#pragma once

// A test seam of the checkpoint writer (device/checkpoint.cpp), not installed: makes its writes
// fail as a full disk does, so that a test can check that a failed save leaves the previous
// checkpoint usable and no temporary file behind, without filling a real disk.

#include <cstddef>

namespace consort::detail {

/// From now on, a checkpoint write that would take the file past `bytes` fails with `error_number`
/// (for example ENOSPC) after writing up to `bytes`; the writes before succeed.
/// Thread safety: process-wide; for tests that save from one thread.
void checkpoint_fail_writes_after(size_t bytes, int error_number);

/// Undoes `checkpoint_fail_writes_after`.
void checkpoint_clear_write_fault();

} // namespace consort::detail
