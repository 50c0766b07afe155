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
