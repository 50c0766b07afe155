# CTest layers.*: the include check that the build runs (cmake/ConsortLayerCheck.cmake) passes on
# the real tree and rejects upward includes, direct or relative ("../actors/x.hpp"), in a tiny tree
# written here.
#
#   cmake -DSOURCE_DIR=<consort source> -DWORK_DIR=<scratch dir> -P layer_check_test.cmake
cmake_minimum_required(VERSION 3.25)
set(check "${SOURCE_DIR}/cmake/ConsortLayerCheck.cmake")

# run_check(TREE RESULT OUTPUT): runs the check on TREE.
function(run_check tree result_var output_var)
  execute_process(COMMAND "${CMAKE_COMMAND}" -DSOURCE_DIR=${tree} -P "${check}"
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${result_var} "${result}" PARENT_SCOPE)
  set(${output_var} "${out}${err}" PARENT_SCOPE)
endfunction()

function(expect_contains output text)
  string(FIND "${output}" "${text}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the check's output lacks \"${text}\":\n${output}")
  endif()
endfunction()

function(expect_lacks output text)
  string(FIND "${output}" "${text}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "the check's output has \"${text}\":\n${output}")
  endif()
endfunction()

# 1. The real tree passes.
run_check("${SOURCE_DIR}" result output)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the layer check fails on the source tree:\n${output}")
endif()

# 2. A tree whose includes all go down passes.
set(tree "${WORK_DIR}/layer_check_good")
file(REMOVE_RECURSE "${tree}")
file(WRITE "${tree}/include/consort/error.hpp" "#pragma once\n")
file(WRITE "${tree}/include/consort/tensor.hpp" "#pragma once\n#include <consort/error.hpp>\n")
file(WRITE "${tree}/device/kernels.cpp"
     "#include \"core/private.hpp\"\n#include <consort/tensor.hpp>\n#include <vector>\n")
file(WRITE "${tree}/transport/pair.cpp"
     "#include \"device/gpu.hpp\"\n#include <consort/cluster.hpp>\n#include <caf/all.hpp>\n")
file(WRITE "${tree}/actors/strategy.cpp"
     "#include \"transport/tcp/wire.hpp\"\n#include <consort/strategy.hpp>\n")
# Relative includes that stay in their layer, or go down.
file(WRITE "${tree}/device/cuda/kernels.cu"
     "#include \"../gpu.hpp\"\n#include \"nccl.hpp\"\n#include \"../../core/error.hpp\"\n")
file(WRITE "${tree}/transport/shm/shm_context.cpp" "#include \"../auth.hpp\"\n")
file(WRITE "${tree}/include/consort/transport/tcp.hpp"
     "#pragma once\n#include \"pair.hpp\"\n#include \"../error.hpp\"\n")
run_check("${tree}" result output)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the layer check rejects includes that go down:\n${output}")
endif()

# 3. Upward includes fail, each named with its file, line and rule; the good ones stay quiet.
set(tree "${WORK_DIR}/layer_check_bad")
file(REMOVE_RECURSE "${tree}")
file(WRITE "${tree}/include/consort/error.hpp" "#pragma once\n")
# A public header of core that includes one of device.
file(WRITE "${tree}/include/consort/reduce_op.hpp"
     "#pragma once\n#include <consort/error.hpp>\n#include <consort/tensor.hpp>\n")
# A private include up, after lines whose ; [ ] and \ must not shift the line count.
file(WRITE "${tree}/core/nest_paths.cpp"
     "int a[2]; int b;\n#define X \\\n  1\n#include \"actors/protocol.hpp\"\n")
# A public header of a layer above, and one that has no layer.
file(WRITE "${tree}/device/gpu.cpp"
     "#include \"core/error.hpp\"\n#include <consort/strategy.hpp>\n#include <consort/new.hpp>\n")
# Up a level that is not its own: cluster may not use transport.
file(WRITE "${tree}/cluster/slurm.cpp" "#include <consort/transport/tcp.hpp>\n")
# Relative includes up: one and two levels, through a layer's own directory, to a public header,
# and a relative include that stays in its layer (quiet).
file(WRITE "${tree}/cluster/resolver.cpp" "#include \"../actors/protocol.hpp\"\n")
file(WRITE "${tree}/device/cuda/nccl.cu"
     "#include \"../gpu.hpp\"\n#include \"../../transport/tcp/wire.hpp\"\n")
file(WRITE "${tree}/device/ops.cpp" "#include \"core/../actors/protocol.hpp\"\n")
file(WRITE "${tree}/include/consort/tensor.hpp" "#pragma once\n#include \"strategy.hpp\"\n")
run_check("${tree}" result output)
if(result EQUAL 0)
  message(FATAL_ERROR "the layer check accepted upward includes:\n${output}")
endif()
expect_contains("${output}" "9 include(s) against the layering")
expect_contains("${output}" "include/consort/reduce_op.hpp:3: includes <consort/tensor.hpp> of layer 'device', but layer 'core' may include only core")
expect_contains("${output}" "core/nest_paths.cpp:4: includes actors/protocol.hpp of layer 'actors', but layer 'core' may include only core")
expect_contains("${output}" "device/gpu.cpp:2: includes <consort/strategy.hpp> of layer 'actors', but layer 'device' may include only device, core")
expect_contains("${output}" "device/gpu.cpp:3: includes <consort/new.hpp>, a public header that cmake/ConsortLayerTable.cmake gives no layer")
expect_contains("${output}" "cluster/slurm.cpp:1: includes <consort/transport/tcp.hpp> of layer 'transport', but layer 'cluster' may include only cluster, core, device")
expect_contains("${output}" "cluster/resolver.cpp:1: includes \"../actors/protocol.hpp\" (actors/protocol.hpp) of layer 'actors', but layer 'cluster' may include only cluster, core, device")
expect_contains("${output}" "device/cuda/nccl.cu:2: includes \"../../transport/tcp/wire.hpp\" (transport/tcp/wire.hpp) of layer 'transport', but layer 'device' may include only device, core")
expect_contains("${output}" "device/ops.cpp:1: includes \"core/../actors/protocol.hpp\" (actors/protocol.hpp) of layer 'actors', but layer 'device' may include only device, core")
expect_contains("${output}" "include/consort/tensor.hpp:2: includes \"strategy.hpp\" (<consort/strategy.hpp>) of layer 'actors', but layer 'device' may include only device, core")
expect_lacks("${output}" "device/gpu.cpp:1")
expect_lacks("${output}" "device/cuda/nccl.cu:1")

# 4. A public header the table does not know fails even when nothing includes it.
set(tree "${WORK_DIR}/layer_check_unlisted")
file(REMOVE_RECURSE "${tree}")
file(WRITE "${tree}/include/consort/detail/internal.hpp" "#pragma once\n")
run_check("${tree}" result output)
if(result EQUAL 0)
  message(FATAL_ERROR "the layer check accepted a public header without a layer:\n${output}")
endif()
expect_contains("${output}" "include/consort/detail/internal.hpp: a public header that cmake/ConsortLayerTable.cmake gives no layer")
message(STATUS "layer check: accepts the tree and downward includes, rejects 9 upward ones")
