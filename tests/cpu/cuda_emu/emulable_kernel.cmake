# Writes a copy of a kernel header that g++ compiles under the CUDA emulation (cuda_emu.h beside
# this file), for tests that run the kernels themselves on the CPU:
#  - launch configurations cut: `kernel<<<grid, block, smem, stream>>>(args)` becomes
#    `kernel(args)`, which g++ can parse (the launchers are never instantiated by the emulated
#    tests, which call the kernels through cuda_emu::launch);
#  - PTX-only helpers that the header defines itself (`asm` that names a PTX instruction) dropped,
#    for the emulated ones of src/attention/portable/warp_mma.h beside this file: cp_async_4.
# Everything else is copied unchanged, with #line so that diagnostics name the original file.
# Usage: cmake -DIN=<header> -DOUT=<copy> -P emulable_kernel.cmake
file(READ "${IN}" text)
string(REGEX REPLACE "<<<[^;]*>>>" "" text "${text}")
foreach(helper cp_async_4)
  string(REGEX MATCH "__device__ __forceinline__ void ${helper}\\([^)]*\\) {[^}]*}" definition "${text}")
  if(definition)
    string(REGEX REPLACE "[^\n]" "" newlines "${definition}")  # keeps the line numbers
    string(REPLACE "${definition}" "/* ${helper}: emulated (tests/cpu/cuda_emu) */${newlines}" text "${text}")
  endif()
endforeach()
if(text MATCHES "<<<")
  message(FATAL_ERROR "${IN}: a launch configuration this script cannot cut")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by ${CMAKE_CURRENT_LIST_FILE}: do not edit.\n#line 1 \"${IN}\"\n${text}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
