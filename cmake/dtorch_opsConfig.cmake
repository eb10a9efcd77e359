# find_package(dtorch_ops): the C++ API of the installed Python package dtorch_ops.
#
#   list(APPEND CMAKE_PREFIX_PATH <python -c 'import dtorch_ops; print(dtorch_ops.cmake_prefix_path())'>)
#   find_package(dtorch_ops REQUIRED)
#   target_link_libraries(my_program PRIVATE dtorch_ops::dtorch_ops)
#
# Defines the imported target dtorch_ops::dtorch_ops (the include directory of <dtorch/dtorch.h>,
# libdtorch_ops.so and torch), and dtorch_ops_INCLUDE_DIRS, dtorch_ops_LIBRARY (the .so's path)
# and dtorch_ops_LIBRARIES (the target). Torch is found here unless the project found it first
# (find_package(Torch)). This file lies in <package>/share/cmake/dtorch_ops/ (setup.py puts it
# there with the headers); everything else is found relative to it.
get_filename_component(_dtorch_ops_package "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(dtorch_ops_INCLUDE_DIRS "${_dtorch_ops_package}/include")
set(dtorch_ops_LIBRARY "${_dtorch_ops_package}/libdtorch_ops.so")
foreach(_dtorch_ops_file IN ITEMS "${dtorch_ops_INCLUDE_DIRS}/dtorch/dtorch.h" "${dtorch_ops_LIBRARY}")
  if(NOT EXISTS "${_dtorch_ops_file}")
    set(dtorch_ops_FOUND FALSE)
    set(dtorch_ops_NOT_FOUND_MESSAGE
        "${_dtorch_ops_file} is missing: reinstall dtorch_ops (pip install --no-build-isolation .)")
    return()
  endif()
endforeach()

include(CMakeFindDependencyMacro)
if(NOT TARGET torch)
  find_dependency(Torch)
endif()

if(NOT TARGET dtorch_ops::dtorch_ops)
  # A CUDA build of torch: the library (built with its CUDA sources) needs libc10_cuda.so, which
  # the program then loads itself, found through its run path (the library has none of its own).
  set(_dtorch_ops_link "-Wl,--no-as-needed" "${dtorch_ops_LIBRARY}")
  if(TARGET c10_cuda)
    list(APPEND _dtorch_ops_link "$<TARGET_FILE:c10_cuda>")
  endif()
  list(APPEND _dtorch_ops_link "-Wl,--as-needed" torch)
  add_library(dtorch_ops::dtorch_ops INTERFACE IMPORTED)
  set_target_properties(dtorch_ops::dtorch_ops PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${dtorch_ops_INCLUDE_DIRS}"
    # --no-as-needed keeps the library loaded even where the program calls none of its functions:
    # its static initialisers register torch.ops.dtorch.* and torch.classes.dtorch.*, which
    # torch::jit::load needs for a module that uses them. CMake puts the library's directory in
    # the run path of the programs it builds; `cmake --install` drops it unless the project sets
    # INSTALL_RPATH (or CMAKE_INSTALL_RPATH_USE_LINK_PATH).
    INTERFACE_LINK_LIBRARIES "${_dtorch_ops_link}"
    # torch 2.13's headers need C++20 (its imported target does not pass that on).
    INTERFACE_COMPILE_FEATURES cxx_std_20)
endif()
set(dtorch_ops_LIBRARIES dtorch_ops::dtorch_ops)
unset(_dtorch_ops_file)
unset(_dtorch_ops_link)
unset(_dtorch_ops_package)
