# Warnings of our own targets (the consort library, its tests, benchmarks and examples).
#
# consort_target_warnings(TARGET): -Wall -Wextra on the target's C++ and CUDA sources, plus -Werror
# on its C++ sources when CONSORT_WERROR is ON (tools/test.sh and tools/sanitize.sh turn it on; it
# is OFF by default so that a newer compiler's new warning does not break a user's build). nvcc
# never gets -Werror: the host compiler's warnings on the code nvcc generates are not ours to fix.

option(CONSORT_WERROR "Treat compiler warnings in consort's own targets as errors" OFF)

function(consort_target_warnings target)
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX,CUDA>:-Wall;-Wextra>")
  if(CONSORT_WERROR)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-Werror>")
  endif()
endfunction()

# consort_test_target(TARGET): the code generation of a unit-test program (not of the library it
# tests, nor of the benchmarks, the examples and mw_job, whose loops over 1 Mi elements are hot
# and which keep the build type's flags). Test code is compiled at
# CONSORT_TEST_OPTIMIZE, -O0 by default: the tests' own code is not hot (the work is done in the
# library), and -O0 halves their compile time on CI's two cores (tests/transport/tcp_test.cpp:
# 17 s at -O3, 10 s at -O0; the tests are 60 % of the build). Set it empty to use the build type's.
set(CONSORT_TEST_OPTIMIZE "-O0" CACHE STRING
    "Optimisation flag for consort's test programs (empty: the build type's)")

function(consort_test_target target)
  consort_target_warnings(${target})
  if(CONSORT_TEST_OPTIMIZE)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${CONSORT_TEST_OPTIMIZE}>")
  endif()
endfunction()
