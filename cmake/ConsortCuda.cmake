# CUDA and NCCL support (CONSORT_WITH_CUDA = AUTO | ON | OFF).
#
# AUTO turns CUDA on when a CUDA compiler is found (nvcc under /usr/local/cuda is looked for even
# when it is not on PATH) and NCCL is found beside it; ON fails the configure when either is
# missing; OFF never looks. Only the runtime API is used (CUDA::cudart): a binary linked this way
# starts on a machine without a GPU or driver, where cudaGetDeviceCount reports an error and the
# GPU paths say so. The driver library (-lcuda) is never linked: it does not load without a driver.
#
# Sets CONSORT_HAVE_CUDA (ON/OFF) and, when ON, the imported target consort::nccl.

set(_consort_cuda_request "${CONSORT_WITH_CUDA}")
string(TOUPPER "${_consort_cuda_request}" _consort_cuda_request)
if(NOT _consort_cuda_request MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "CONSORT_WITH_CUDA is \"${CONSORT_WITH_CUDA}\"; expected AUTO, ON or OFF")
endif()
if(_consort_cuda_request MATCHES "^(TRUE|YES|1)$")
  set(_consort_cuda_request ON)
elseif(_consort_cuda_request MATCHES "^(FALSE|NO|0)$")
  set(_consort_cuda_request OFF)
endif()

set(CONSORT_HAVE_CUDA OFF)
if(NOT _consort_cuda_request STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS "/usr/local/cuda/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc" CACHE FILEPATH "CUDA compiler")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # The GPUs users have: machine code for sm_80 (A100; it also runs on sm_86 and sm_89, the
      # L4) and sm_90 (H100, H200), and sm_90 PTX that the driver compiles for newer GPUs at first
      # load. Override with -DCMAKE_CUDA_ARCHITECTURES=... (e.g. 90 alone for a faster build).
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual" CACHE STRING "CUDA architectures")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    find_package(NCCL)
    if(NCCL_FOUND)
      set(CONSORT_HAVE_CUDA ON)
    elseif(_consort_cuda_request STREQUAL "ON")
      message(FATAL_ERROR "CONSORT_WITH_CUDA=ON but NCCL was not found (looked beside the CUDA "
                          "toolkit at ${CUDAToolkit_LIBRARY_DIR}; set NCCL_ROOT)")
    else()
      message(STATUS "consort: CUDA compiler found but no NCCL; building without CUDA")
    endif()
  elseif(_consort_cuda_request STREQUAL "ON")
    message(FATAL_ERROR "CONSORT_WITH_CUDA=ON but no CUDA compiler was found (set CUDACXX or "
                        "CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "consort: no CUDA compiler found; building without CUDA")
  endif()
endif()
if(CONSORT_HAVE_CUDA)
  set(CONSORT_CUDA_01 1)
else()
  set(CONSORT_CUDA_01 0)
endif()
message(STATUS "consort: CUDA support ${CONSORT_HAVE_CUDA}")
