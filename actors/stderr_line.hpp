#pragma once

// One line of the runtime's own output on stderr, written with one write.
//
// `std::cerr << a << b << std::endl` writes each piece on its own (stderr is unbuffered), so a
// line of the program's stdout that shares the pipe (a launcher's, a log collector's) can land
// in the middle of it: "consort: " from here, then the program's line, then the rest. One
// fwrite of the whole line keeps lines whole, as transport/tcp and transport/membership do.

#include <cstdio>
#include <string>

namespace consort::detail {

inline void write_stderr_line(std::string line) noexcept {
  line.insert(0, "consort: ");
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
}

} // namespace consort::detail
