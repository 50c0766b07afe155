# The include check of the layers (docs/architecture.md), in script mode:
#
#   cmake -DSOURCE_DIR=<tree> [-DSTAMP=<file>] -P cmake/ConsortLayerCheck.cmake
#
# Reads every source and header of every layer under SOURCE_DIR (its directories, and its public
# headers under include/consort/) and fails, naming file, line and rule, when one includes a
# header of a layer it may not use (cmake/ConsortLayerTable.cmake): a private header
# #include "DIR/..." of another layer's directory, or a public header #include <consort/...> of
# another layer. A public header that the table does not list fails too, so that a new header gets
# a layer. On success it touches STAMP. The build runs it before compiling any layer
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
    set(target "")
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[\"<]consort/([^\">]+)[\">]")
      set(header "${CMAKE_MATCH_1}")
      string(MAKE_C_IDENTIFIER "${header}" id)
      if(NOT DEFINED _header_layer_${id})
        string(CONCAT msg "${rel}:${number}: includes <consort/${header}>, a public header that "
                          "cmake/ConsortLayerTable.cmake gives no layer")
        list(APPEND found "${msg}")
        continue()
      endif()
      set(target ${_header_layer_${id}})
      set(what "<consort/${header}>")
    elseif(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[\"<]([A-Za-z0-9_]+)/([^\">]+)[\">]")
      set(dir "${CMAKE_MATCH_1}")
      if(NOT DEFINED _dir_layer_${dir})
        continue() # not ours: <caf/...>, <boost/...>, "support/..."
      endif()
      set(target ${_dir_layer_${dir}})
      set(what "${dir}/${CMAKE_MATCH_2}")
    else()
      continue()
    endif()
    if(NOT target IN_LIST allowed)
      string(REPLACE ";" ", " may "${allowed}")
      string(CONCAT msg "${rel}:${number}: includes ${what} of layer '${target}', but layer "
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
