/*
** hd.h — DM_HD marks a function that host code and CUDA kernels share,
** defined in a header: static inline, and __host__ __device__ where nvcc
** compiles it. The one spelling every such header uses.
*/
#ifndef DM_HD_H
#define DM_HD_H

#ifdef __CUDACC__
#define DM_HD static inline __host__ __device__
#else
#define DM_HD static inline
#endif

#endif
