// A deliberately broken kernel: every thread writes through a null pointer, an illegal memory
// access that poisons the CUDA context. The tuner must record it and carry on in a new worker.
#include "autofuse.cuh"

__global__ void write_null(float* out) { out[threadIdx.x] = 1.f; }

AF_EXPORT int af_illegal_access(float* unused, cudaStream_t stream) {
    write_null<<<1, 32, 0, stream>>>(nullptr);
    AF_CHECK_LAUNCH();
}
