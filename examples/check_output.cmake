# Runs one example and checks it against the header of its source (run by CTest, see
# CMakeLists.txt):
#   cmake -DEXAMPLE=<program> -DSOURCE=<example.cpp> -P check_output.cmake
#
# The example must exit 0 and print to stdout exactly the lines of its "// Expected output:"
# block: the comment lines that follow it up to the first line that is not a `//` comment, each
# with its `//   ` prefix removed. In an expected line, `<...>` stands for any text within that line
# (for parts of a message that depend on thread timing, such as which replica arrived first).
# String operations only, no CMake lists: example output contains `[`, `]` and `;`.

if(NOT EXAMPLE OR NOT SOURCE)
  message(FATAL_ERROR
          "usage: cmake -DEXAMPLE=<program> -DSOURCE=<source.cpp> -P ${CMAKE_CURRENT_LIST_FILE}")
endif()

file(READ "${SOURCE}" source_text)
string(FIND "${source_text}" "// Expected output:\n" start)
if(start EQUAL -1)
  message(FATAL_ERROR "${SOURCE} has no \"// Expected output:\" block")
endif()
string(LENGTH "// Expected output:\n" marker_length)
math(EXPR start "${start} + ${marker_length}")
string(SUBSTRING "${source_text}" ${start} -1 tail)
string(REGEX MATCH "^(//[^\n]*\n)*" block "${tail}")
# Strip the comment prefix of every line ("//   text" -> "text", "//" -> "").
set(expected "\n${block}")
string(REPLACE "\n//   " "\n" expected "${expected}")
string(REGEX REPLACE "\n//[ ]*\n" "\n\n" expected "${expected}")
string(REGEX REPLACE "\n//[ ]*\n" "\n\n" expected "${expected}") # consecutive empty lines
string(SUBSTRING "${expected}" 1 -1 expected)

execute_process(COMMAND "${EXAMPLE}" RESULT_VARIABLE rc OUTPUT_VARIABLE actual
                ERROR_VARIABLE errors TIMEOUT 50)
# Plain message() prints the text as it is; FATAL_ERROR would re-wrap it.
if(NOT rc EQUAL 0)
  message("--- stdout\n${actual}--- stderr\n${errors}---")
  message(FATAL_ERROR "${EXAMPLE} exited with ${rc}")
endif()

# The expected text as a regular expression: escape it, then turn each `<...>` into "any text".
string(REGEX REPLACE "([][+.*()^$?|])" "\\\\\\1" pattern "${expected}")
string(REPLACE "<\\.\\.\\.>" "[^\n]*" pattern "${pattern}")
if(NOT actual MATCHES "^${pattern}$")
  message("--- expected\n${expected}--- actual\n${actual}--- stderr\n${errors}---")
  message(FATAL_ERROR "${EXAMPLE} does not print the \"Expected output:\" of ${SOURCE}")
endif()
message(STATUS "${EXAMPLE}: output matches ${SOURCE}")
