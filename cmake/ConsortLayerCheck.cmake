# The include check of the layers (docs/architecture.md), in script mode:
#
#   cmake -DSOURCE_DIR=<tree> [-DSTAMP=<file>] -P cmake/ConsortLayerCheck.cmake
#
# Reads every source and header of every layer under SOURCE_DIR (its directories, and its public
# headers under include/consort/) and fails, naming file, line and rule, when one includes a
# header of a layer it may not use (cmake/ConsortLayerTable.cmake): a private header
# #include "DIR/..." of another layer's directory, a public header #include <consort/...> of
# another layer, or a quoted include relative to the including file ("../actors/x.hpp") that lands
# in another layer's directory or public headers. A public header that the table does not list
# fails too, so that a new header gets a layer. On success it touches STAMP. The build runs it before compiling any layer
# (cmake/ConsortLayers.cmake), so an upward include fails the build, not only a test.
cmake_minimum_required(VERSION 3.25)

if(NOT DEFINED SOURCE_DIR)
  message(FATAL_ERROR "ConsortLayerCheck: set -DSOURCE_DIR=<source tree>")
endif()
include("${CMAKE_CURRENT_LIST_DIR}/ConsortLayerTable.cmake")

# Owners: private directory -> layer, public header -> layer.
foreach(layer IN LISTS CONSORT_LAYERS)
  foreach(dir IN LISTS CONSORT_LAYER_${layer}_DIRS)
    set(_dir_layer_${dir} ${layer})
  endforeach()
  foreach(header IN LISTS CONSORT_LAYER_${layer}_HEADERS)
    string(MAKE_C_IDENTIFIER "${header}" id)
    set(_header_layer_${id} ${layer})
  endforeach()
endforeach()

set(violations "")
set(checked 0)

# top_dir(PATH OUT): OUT is the first directory of the relative PATH when it is a layer's directory
# ("actors" for actors/x.hpp), else empty.
function(top_dir path out)
  set(dir "")
  if(path MATCHES "^([A-Za-z0-9_]+)/")
    if(DEFINED _dir_layer_${CMAKE_MATCH_1})
      set(dir "${CMAKE_MATCH_1}")
    endif()
  endif()
  set(${out} "${dir}" PARENT_SCOPE)
endfunction()

# check_file(FILE LAYER): appends to `violations` every include of FILE that LAYER may not use.
function(check_file file layer)
  file(RELATIVE_PATH rel "${SOURCE_DIR}" "${file}")
  # One list element per line. Characters that CMake's lists treat specially (; [ ] \) become
  # harmless ones first: only #include lines matter, and their line numbers stay right.
  file(READ "${file}" content)
  string(REPLACE "\\" "/" content "${content}")
  string(REPLACE ";" "," content "${content}")
  string(REPLACE "[" "(" content "${content}")
  string(REPLACE "]" ")" content "${content}")
  string(REPLACE "\n" ";" lines "${content}")
  set(allowed ${layer} ${CONSORT_LAYER_${layer}_USES})
  set(number 0)
  set(found "")
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*([\"<])([^\">]+)[\">]")
      continue()
    endif()
    set(delim "${CMAKE_MATCH_1}")
    set(path "${CMAKE_MATCH_2}")
    # Lexically normalised, so that "core/../actors/x.hpp" is seen as the actors/x.hpp it is.
    cmake_path(SET path_norm NORMALIZE "${path}")
    top_dir("${path_norm}" path_dir)
    set(header "")
    set(dir "")
    if(path_norm MATCHES "^consort/(.+)$")
      set(header "${CMAKE_MATCH_1}")
      set(shown "<consort/${header}>")
    elseif(NOT path_dir STREQUAL "")
      set(dir "${path_dir}")
      set(shown "${path_norm}")
      if(NOT path_norm STREQUAL path)
        set(shown "\"${path}\" (${path_norm})")
      endif()
    elseif(delim STREQUAL "\"")
      # A quoted include relative to the including file ("../actors/x.hpp", "../auth.hpp",
      # "tensor.hpp" next to a public header): resolved against the file's directory, it is
      # judged by where it lands, as the compiler looks there first.
      cmake_path(GET rel PARENT_PATH base)
      cmake_path(APPEND base "${path}" OUTPUT_VARIABLE landed)
      cmake_path(NORMAL_PATH landed)
      top_dir("${landed}" landed_dir)
      if(landed MATCHES "^include/consort/(.+)$")
        set(header "${CMAKE_MATCH_1}")
        set(shown "\"${path}\" (<consort/${header}>)")
      elseif(NOT landed_dir STREQUAL "")
        set(dir "${landed_dir}")
        set(shown "\"${path}\" (${landed})")
      else()
        continue() # not a layer's file: outside the tree, tests/, tools/
      endif()
    else()
      continue() # not ours: <caf/...>, <boost/...>, "support/..."
    endif()
    if(NOT header STREQUAL "")
      string(MAKE_C_IDENTIFIER "${header}" id)
      if(NOT DEFINED _header_layer_${id})
        string(CONCAT msg "${rel}:${number}: includes ${shown}, a public header that "
                          "cmake/ConsortLayerTable.cmake gives no layer")
        list(APPEND found "${msg}")
        continue()
      endif()
      set(target ${_header_layer_${id}})
    else()
      set(target ${_dir_layer_${dir}})
    endif()
    if(NOT target IN_LIST allowed)
      string(REPLACE ";" ", " may "${allowed}")
      string(CONCAT msg "${rel}:${number}: includes ${shown} of layer '${target}', but layer "
                        "'${layer}' may include only ${may}")
      list(APPEND found "${msg}")
    endif()
  endforeach()
  set(violations ${violations} ${found} PARENT_SCOPE)
endfunction()

foreach(layer IN LISTS CONSORT_LAYERS)
  set(files "")
  foreach(dir IN LISTS CONSORT_LAYER_${layer}_DIRS)
    file(GLOB_RECURSE dir_files "${SOURCE_DIR}/${dir}/*.cpp" "${SOURCE_DIR}/${dir}/*.hpp"
         "${SOURCE_DIR}/${dir}/*.cu" "${SOURCE_DIR}/${dir}/*.cuh")
    list(APPEND files ${dir_files})
  endforeach()
  foreach(header IN LISTS CONSORT_LAYER_${layer}_HEADERS)
    foreach(candidate "${SOURCE_DIR}/include/consort/${header}"
                      "${SOURCE_DIR}/include/consort/${header}.in")
      if(EXISTS "${candidate}")
        list(APPEND files "${candidate}")
      endif()
    endforeach()
  endforeach()
  foreach(file IN LISTS files)
    check_file("${file}" ${layer})
    math(EXPR checked "${checked} + 1")
  endforeach()
endforeach()

# Every public header must have a layer.
file(GLOB_RECURSE public RELATIVE "${SOURCE_DIR}/include/consort"
     "${SOURCE_DIR}/include/consort/*.hpp" "${SOURCE_DIR}/include/consort/*.hpp.in")
foreach(header IN LISTS public)
  string(REGEX REPLACE "\\.in$" "" header "${header}")
  string(MAKE_C_IDENTIFIER "${header}" id)
  if(NOT DEFINED _header_layer_${id})
    list(APPEND violations
         "include/consort/${header}: a public header that cmake/ConsortLayerTable.cmake gives no layer")
  endif()
endforeach()

if(violations)
  list(LENGTH violations count)
  string(REPLACE ";" "\n  " text "${violations}")
  message(FATAL_ERROR "consort layer check: ${count} include(s) against the layering "
                      "(docs/architecture.md, cmake/ConsortLayerTable.cmake):\n  ${text}\n")
endif()
message(STATUS "consort layer check: ${checked} files, no upward include")
if(DEFINED STAMP)
  file(TOUCH "${STAMP}")
endif()
