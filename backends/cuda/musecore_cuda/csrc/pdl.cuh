// Programmatic dependent launch (SM90+ griddepcontrol); a no-op on older targets and without the launch attribute.
__device__ __forceinline__ void pdl_trigger() {  // the next kernel may be scheduled now
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {  // the previous kernel has completed; its writes are visible
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
