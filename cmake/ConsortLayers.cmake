# One CMake target per layer of the library (docs/architecture.md), with the layer order and the
# allowed uses in cmake/ConsortLayerTable.cmake. Two checks keep a lower layer from reaching up:
#
# - Includes, at compile time: consort_layer_check runs cmake/ConsortLayerCheck.cmake over every
#   layer's sources and public headers before any layer compiles, and fails the build on an
#   include of a layer above. (Include directories alone cannot do it: every layer's public
#   headers share include/consort/, and the private ones share the source root.)
# - Calls, at link time: each layer is an OBJECT library, and consort_<layer>_link_check links its
#   objects with those of the layers it may use, and nothing else, into a shared library with
#   --no-undefined. A call into a layer above (say, through a re-declared function instead of an
#   include) is then an undefined symbol, and the build fails there, as it would with CAF's
#   separate libcaf_core/libcaf_io.
#
# Why OBJECT libraries: the installed library stays one archive, libconsort.a, exported as
# consort::consort with the same link interface as before. The layers are only build-tree targets
# (nothing to install or export for them), and each source compiles once for both the archive and
# the link checks. STATIC libraries per layer would not catch an upward call either: an archive is
# never linked on its own, and the final link sees every layer.

include("${CMAKE_CURRENT_LIST_DIR}/ConsortLayerTable.cmake")

# A sanitizer runtime is linked into executables only (Clang), so a shared library built with
# -fsanitize has undefined __asan_*/__tsan_* symbols by design: the link checks are off there (the
# plain build, which CI also runs, keeps them).
if(CONSORT_SANITIZE STREQUAL "" AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
  set(_consort_link_check_default ON)
else()
  set(_consort_link_check_default OFF)
endif()
option(CONSORT_LAYER_LINK_CHECK "Link each layer alone (--no-undefined) to catch upward calls"
       ${_consort_link_check_default})

# What every layer compiles against: the public headers (with the generated config.hpp), the source
# root for the private headers ("device/gpu.hpp"), and what the public headers need.
add_library(consort_layer_base INTERFACE)
target_include_directories(consort_layer_base INTERFACE
  "${PROJECT_SOURCE_DIR}/include" "${PROJECT_BINARY_DIR}/include" "${PROJECT_SOURCE_DIR}")
target_link_libraries(consort_layer_base INTERFACE CAF::core Boost::headers Threads::Threads)
target_compile_features(consort_layer_base INTERFACE cxx_std_20)

# The include check, run before any layer compiles, again whenever a layer's file changes.
file(GLOB_RECURSE _consort_layer_files CONFIGURE_DEPENDS
     "${PROJECT_SOURCE_DIR}/include/consort/*.hpp" "${PROJECT_SOURCE_DIR}/include/consort/*.in")
foreach(_layer IN LISTS CONSORT_LAYERS)
  foreach(_dir IN LISTS CONSORT_LAYER_${_layer}_DIRS)
    file(GLOB_RECURSE _files CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${_dir}/*.cpp"
         "${PROJECT_SOURCE_DIR}/${_dir}/*.hpp" "${PROJECT_SOURCE_DIR}/${_dir}/*.cu")
    list(APPEND _consort_layer_files ${_files})
  endforeach()
endforeach()
set(_consort_layer_stamp "${PROJECT_BINARY_DIR}/consort_layer_check.stamp")
add_custom_command(
  OUTPUT "${_consort_layer_stamp}"
  COMMAND "${CMAKE_COMMAND}" -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -DSTAMP=${_consort_layer_stamp}
          -P "${PROJECT_SOURCE_DIR}/cmake/ConsortLayerCheck.cmake"
  DEPENDS ${_consort_layer_files} "${PROJECT_SOURCE_DIR}/cmake/ConsortLayerCheck.cmake"
          "${PROJECT_SOURCE_DIR}/cmake/ConsortLayerTable.cmake"
  COMMENT "Checking that no layer includes a layer above it"
  VERBATIM)
add_custom_target(consort_layer_check DEPENDS "${_consort_layer_stamp}")

# consort_add_layer(NAME SOURCES...): the OBJECT library consort_<NAME> of one layer of the table,
# using the layers below it that the table allows, and its link check. Sources added later with
# target_sources (generated, CUDA) are in both.
function(consort_add_layer name)
  if(NOT name IN_LIST CONSORT_LAYERS)
    message(FATAL_ERROR "consort_add_layer: '${name}' is not in cmake/ConsortLayerTable.cmake")
  endif()
  set(target consort_${name})
  add_library(${target} OBJECT ${ARGN})
  target_link_libraries(${target} PUBLIC consort_layer_base)
  foreach(lower IN LISTS CONSORT_LAYER_${name}_USES)
    target_link_libraries(${target} PUBLIC consort_${lower})
  endforeach()
  consort_target_warnings(${target})
  add_dependencies(${target} consort_layer_check)

  if(CONSORT_LAYER_LINK_CHECK)
    # An OBJECT library's objects go into a target that links it directly, not transitively:
    # name every allowed layer. The layers' own link dependencies (CAF, OpenSSL, Cap'n Proto,
    # CUDA) come with them.
    add_library(${target}_link_check SHARED)
    target_link_libraries(${target}_link_check PRIVATE ${target})
    foreach(lower IN LISTS CONSORT_LAYER_${name}_USES)
      target_link_libraries(${target}_link_check PRIVATE consort_${lower})
    endforeach()
    target_link_options(${target}_link_check PRIVATE "LINKER:--no-undefined")
  endif()
endfunction()
