// Programmatic dependent launch (sm_90+): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start before the kernel ahead of it in the
// stream has finished, once every CTA of that kernel has called allow_dependent_launch (or exited);
// wait_for_prerequisite_grids then waits for that kernel's completion and its memory. No-ops below
// sm_90 and off the GPU (the launch attribute is not set there either).
#pragma once

namespace flare::device {

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace flare::device
