# Sanitizer builds (CONSORT_SANITIZE = "" | address | thread), run by tools/sanitize.sh.
#
#   address  ASan + UBSan: -fsanitize=address,undefined, and UBSan findings are fatal
#            (-fno-sanitize-recover=undefined; see below for `null`), so a test that trips one
#            fails.
#   thread   TSan.
#
# The flags go on every C and C++ translation unit of the build (the library, the generated Cap'n
# Proto code, tests, examples, benchmarks) and on every link, never on CUDA sources: configure
# these builds with -DCONSORT_WITH_CUDA=OFF. Third-party libraries (libcaf_core, libcapnp/libkj,
# libgtest, libstdc++) come prebuilt and uninstrumented: ASan still sees their heap through its
# malloc interceptors, but TSan does not see their synchronisation (tools/tsan.supp says what is
# suppressed for it, and why). Runtime options live in tools/sanitize.sh.

set(CONSORT_SANITIZE "" CACHE STRING "Sanitizers: empty (none), address (ASan+UBSan) or thread (TSan)")
set_property(CACHE CONSORT_SANITIZE PROPERTY STRINGS "" address thread)

if(CONSORT_SANITIZE STREQUAL "")
  return()
elseif(CONSORT_SANITIZE STREQUAL "address")
  # Every UBSan check aborts, except `null`: CAF 0.17.6's own header dereferences a null
  # shared_ptr<std::tuple<>> on every spawn without arguments (tools/ubsan.supp), and a check
  # compiled to abort cannot be suppressed. `null` stays recoverable in the code and is made fatal
  # at run time (UBSAN_OPTIONS=halt_on_error=1, tools/sanitize.sh), where the suppression applies.
  set(_consort_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined
                              -fsanitize-recover=null)
elseif(CONSORT_SANITIZE STREQUAL "thread")
  set(_consort_sanitize_flags -fsanitize=thread)
else()
  message(FATAL_ERROR "CONSORT_SANITIZE is \"${CONSORT_SANITIZE}\"; expected address, thread or empty")
endif()
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  message(FATAL_ERROR "CONSORT_SANITIZE needs GCC or Clang, not ${CMAKE_CXX_COMPILER_ID}")
endif()
# Frame pointers give the sanitizers' fast unwinder whole stacks.
list(APPEND _consort_sanitize_flags -fno-omit-frame-pointer)
add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_consort_sanitize_flags}>")
# The instrumentation misleads GCC's flow analysis: GCC's manual (-fsanitize=address) warns that
# sanitizers raise the rate of false -Wmaybe-uninitialized warnings and advises against -Werror
# with them. Seen here in Boost.Asio's use_future.hpp (promise_handler, "completion may be used
# uninitialized"), clean in the Release build. It stays a warning, not an error, in these builds.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-Wno-error=maybe-uninitialized>")
  # GCC 12's -Wtsan: "atomic_thread_fence is not supported with -fsanitize=thread", raised by
  # Boost.Asio's std_fenced_block (around every handler it runs) in every TU that uses Asio. TSan
  # does not model fences; Asio's queues are ordered by their mutexes, which it does see. A
  # warning we cannot act on, in a third-party header: off in the TSan build.
  if(CONSORT_SANITIZE STREQUAL "thread")
    add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-Wno-tsan>")
  endif()
endif()
add_link_options(${_consort_sanitize_flags})
message(STATUS "consort: sanitizers ${CONSORT_SANITIZE} (${_consort_sanitize_flags})")
