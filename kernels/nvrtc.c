/*
** nvrtc.c — CUDA source compiled at run time: NVRTC, a disk cache of the
** compiled code, loading, and the CUDA kernel "fuse" that launches the
** kernels dm.fuse generates (vm/ops/fuse.h).
**
** Source is compiled for the device's own architecture (sm_90a on an H100
** or H200; plain sm_XY elsewhere) to machine code, so the driver compiles
** nothing; an architecture newer than this NVRTC knows gets PTX of the
** newest one it does, which the driver compiles. The result is kept in
** $XDG_CACHE_HOME/dormouse/nvrtc (else ~/.cache/dormouse/nvrtc), one file
** per key: a hash of the source, the options, the architecture and NVRTC's
** version, with a second hash inside that must match too. Files are written
** to a temporary name and renamed, so a reader never sees half of one; a
** cache that cannot be written costs a compile per process, with one
** warning. DM_DEBUG=4 prints every source as it is loaded.
**
** Modules are loaded with the runtime's library API (no driver API, so the
** binary needs no libcuda to start), in the relaxed capture mode, so the
** first use of a fused op may happen inside a CUDA graph capture.
*/
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <nvrtc.h>
#include "internal.h"
#include "ops/fuse.h"

#define OPTIONS "-std=c++17"

/* ---- keys ----------------------------------------------------------------------------------- */

static uint64_t fnv1a(uint64_t h, const char *s) {
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return (h ^ 0xff) * 0x100000001b3ull;            /* a separator, so "ab"+"c" differs from "a"+"bc" */
}

/* two independent hashes of everything that makes the compiled code */
static void key_of(const char *src, const char *arch, uint64_t *name, uint64_t *check) {
  int maj = 0, min = 0;
  nvrtcVersion(&maj, &min);
  char version[64];
  snprintf(version, sizeof version, "nvrtc %d.%d", maj, min);
  const char *parts[] = {src, OPTIONS, arch, version};
  uint64_t a = 0xcbf29ce484222325ull, b = 0x84222325cbf29ce4ull;
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) { a = fnv1a(a, parts[i]); b = fnv1a(b, parts[i]); }
  *name = a;
  *check = b;
}

/* ---- the disk cache --------------------------------------------------------------------------- */

#define MAGIC "DMNVRTC1"

static const char *cache_dir(void) {
  static char dir[4096];
  if (dir[0]) return dir;
  const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
  if (xdg && *xdg) snprintf(dir, sizeof dir, "%s/dormouse/nvrtc", xdg);
  else if (home && *home) snprintf(dir, sizeof dir, "%s/.cache/dormouse/nvrtc", home);
  else return NULL;
  return dir;
}

static bool make_dirs(const char *path) {
  char p[4096];
  snprintf(p, sizeof p, "%s", path);
  for (char *s = p + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(p, 0755) != 0 && errno != EEXIST) return false;
    *s = '/';
  }
  return mkdir(p, 0755) == 0 || errno == EEXIST;
}

static void warn_once(const char *fmt, ...) {
  static bool warned;
  if (warned) return;
  warned = true;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "dormouse: warning: NVRTC cache: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, " (kernels are compiled again in each process)\n");
  va_end(ap);
}

/* the cached image (malloc'd) or NULL */
static char *cache_read(const char *file, uint64_t check, size_t *size, bool *ptx) {
  FILE *f = fopen(file, "rb");
  if (!f) return NULL;
  char magic[8];
  uint64_t got = 0, n = 0, is_ptx = 0;
  char *img = NULL;
  if (fread(magic, 1, 8, f) == 8 && memcmp(magic, MAGIC, 8) == 0 && fread(&got, 8, 1, f) == 1 && got == check &&
      fread(&is_ptx, 8, 1, f) == 1 && fread(&n, 8, 1, f) == 1 && n > 0 && n < ((uint64_t)1 << 32) &&
      (img = malloc(n + 1)) && fread(img, 1, n, f) == n) {
    img[n] = 0;
    *size = n;
    *ptx = is_ptx != 0;
  } else {
    free(img);
    img = NULL;
  }
  fclose(f);
  return img;
}

static void cache_write(const char *dir, const char *file, uint64_t check, const char *img, size_t n, bool ptx) {
  if (!make_dirs(dir)) { warn_once("cannot create %s: %s", dir, strerror(errno)); return; }
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", file, (long)getpid());
  FILE *f = fopen(tmp, "wb");
  if (!f) { warn_once("cannot write %s: %s", tmp, strerror(errno)); return; }
  uint64_t head[3] = {check, ptx, n};
  bool ok = fwrite(MAGIC, 1, 8, f) == 8 && fwrite(head, 8, 3, f) == 3 && fwrite(img, 1, n, f) == n;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, file) != 0) {
    warn_once("cannot write %s: %s", file, strerror(errno));
    remove(tmp);
  }
}

/* ---- compiling ------------------------------------------------------------------------------------ */

/* the architecture option for this device: machine code where NVRTC knows it */
static void arch_of_device(char *buf, size_t n) {
  dm_cuda_info info = dm_cuda_device_info();
  int cc = info.major * 10 + info.minor, count = 0, best = 0;
  nvrtcGetNumSupportedArchs(&count);
  int archs[128];
  if (count > 128) count = 128;
  nvrtcGetSupportedArchs(archs);
  for (int i = 0; i < count; i++) {
    if (archs[i] == cc) {
      snprintf(buf, n, "--gpu-architecture=sm_%d%s", cc, cc == 90 ? "a" : "");
      return;
    }
    if (archs[i] < cc && archs[i] > best) best = archs[i];
  }
  snprintf(buf, n, "--gpu-architecture=compute_%d", best ? best : cc);
}

static void nv_check(nvrtcResult r, const char *call, const char *what) {
  if (r != NVRTC_SUCCESS) dm_error("%s: %s failed: %s", what, call, nvrtcGetErrorString(r));
}

/* the compiled image (malloc'd, NUL-terminated: PTX is text) of src for arch;
** a compile error raises with NVRTC's log */
static char *compile(const char *src, const char *arch, const char *what, size_t *size, bool *ptx) {
  nvrtcProgram prog;
  nv_check(nvrtcCreateProgram(&prog, src, "dm_fused.cu", 0, NULL, NULL), "nvrtcCreateProgram", what);
  const char *opts[] = {arch, OPTIONS};
  nvrtcResult r = nvrtcCompileProgram(prog, 2, opts);
  if (r != NVRTC_SUCCESS) {
    size_t n = 0;
    nvrtcGetProgramLogSize(prog, &n);
    char *log = malloc(n + 1);
    if (log) { nvrtcGetProgramLog(prog, log); log[n] = 0; }
    char msg[8192];
    snprintf(msg, sizeof msg, "%s", log ? log : "(no log)");
    free(log);
    nvrtcDestroyProgram(&prog);
    dm_error("%s: NVRTC could not compile the kernel (%s, %s):\n%s", what, nvrtcGetErrorString(r), arch, msg);
  }
  *ptx = strstr(arch, "compute_") != NULL;
  size_t n = 0;
  r = *ptx ? nvrtcGetPTXSize(prog, &n) : nvrtcGetCUBINSize(prog, &n);
  char *img = r == NVRTC_SUCCESS ? malloc(n + 1) : NULL;
  if (img) r = *ptx ? nvrtcGetPTX(prog, img) : nvrtcGetCUBIN(prog, img);
  nvrtcDestroyProgram(&prog);
  if (!img || r != NVRTC_SUCCESS) {
    free(img);
    dm_error("%s: NVRTC gave no code: %s", what, nvrtcGetErrorString(r));
  }
  img[n] = 0;
  *size = n;
  return img;
}

void dm_nvrtc_check(const char *source, const char *arch, const char *what) {
  char opt[64];
  snprintf(opt, sizeof opt, "--gpu-architecture=%s", arch);
  size_t n;
  bool ptx;
  free(compile(source, opt, what, &n, &ptx));
}

/* ---- loading ------------------------------------------------------------------------------------ */

/* loaded libraries by key, so one source is loaded once */
#define MAX_LIBS 1024
static struct { uint64_t key; cudaLibrary_t lib; } libs[MAX_LIBS];
static int n_libs;

static cudaLibrary_t load(const char *src, const char *what) {
  char arch[64];
  arch_of_device(arch, sizeof arch);
  uint64_t key, check;
  key_of(src, arch, &key, &check);
  for (int i = 0; i < n_libs; i++) if (libs[i].key == key) return libs[i].lib;
  const char *dir = cache_dir();
  char file[4200] = "";
  if (dir) snprintf(file, sizeof file, "%s/%016llx.bin", dir, (unsigned long long)key);
  size_t n = 0;
  bool ptx = false, cached = false;
  char *img = dir ? cache_read(file, check, &n, &ptx) : NULL;
  if (img) cached = true;
  else {
    img = compile(src, arch, what, &n, &ptx);
    if (dir) cache_write(dir, file, check, img, n, ptx);
    else warn_once("neither XDG_CACHE_HOME nor HOME is set");
  }
  if (dm_debug_level() >= 4)
    fprintf(stderr, "dormouse: %s: CUDA source (%s, %s %s):\n%s\n", what, arch,
            cached ? "from the cache" : "compiled, cached as", dir ? file : "nowhere", src);
  /* loading is no stream work: allowed while a graph is being captured */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaLibrary_t lib;
  cudaError_t e = cudaLibraryLoadData(&lib, img, NULL, NULL, 0, NULL, NULL, 0);
  cudaThreadExchangeStreamCaptureMode(&mode);
  free(img);
  if (e != cudaSuccess) {
    cudaGetLastError();
    dm_error("%s: loading the compiled kernel failed: %s", what, cudaGetErrorString(e));
  }
  if (n_libs < MAX_LIBS) { libs[n_libs].key = key; libs[n_libs++].lib = lib; }
  return lib;
}

void *dm_nvrtc_kernel(const char *source, const char *name, const char *what) {
  dm_cuda_init();
  cudaLibrary_t lib = load(source, what);
  cudaKernel_t k;
  cudaError_t e = cudaLibraryGetKernel(&k, lib, name);
  if (e != cudaSuccess) {
    cudaGetLastError();
    dm_error("%s: no kernel '%s' in the compiled code: %s", what, name, cudaGetErrorString(e));
  }
  return (void *)k;
}

/* ---- the kernel "fuse" -------------------------------------------------------------------------- */

/* the launch's one argument: the layout of dm.fuse's kernels (lua/dormouse/fuse.lua, SKELETON) */
typedef struct fargs {
  int64_t n;
  int64_t shape[DM_MAXDIM];
  int64_t st[DM_FUSE_MAXOPS][DM_MAXDIM];
  void *out[DM_FUSE_MAXIN];
  const void *in[DM_FUSE_MAXIN + 1];
  int ndim;
  unsigned scalar;
} fargs;

/* the source of one direction for one dtype; kept in one buffer, reused */
static const char *full_source(const char *src, dm_dtype dt) {
  static char *buf;
  static size_t cap;
  size_t n = strlen(src) + 64;
  if (n > cap) {
    char *b = realloc(buf, n);
    if (!b) dm_error("dm.fuse: out of host memory");
    buf = b;
    cap = n;
  }
  snprintf(buf, cap, "#define DM_DTYPE %d\n%s", (int)dt, src);
  return buf;
}

static void *kernel_of(dm_fused *f, int dir, dm_dtype dt, bool flat) {
  void **slot = &f->kernels[dir][dt][flat];
  if (*slot) return *slot;
  if (!f->source[dir])
    dm_error("fuse: no cuda kernel for 'fuse' of '%s': it was made without CUDA source (make fused ops with "
             "dm.fuse)", f->expr);
  char what[512];
  snprintf(what, sizeof what, "dm.fuse '%s' (%s, %s)", f->expr, dir == DM_FUSE_FWD ? "forward" : "backward",
           dm_dtype_name(dt));
  *slot = dm_nvrtc_kernel(full_source(f->source[dir], dt), flat ? "dm_fused_flat" : "dm_fused_strided", what);
  return *slot;
}

static void cuda_fuse(dm_fused *f, int dir, dm_tensor *const *out, int n_in, dm_tensor *const *in) {
  int n_out = f->n_out[dir];
  dm_tensor *ops[DM_FUSE_MAXOPS], *lead = NULL;
  for (int k = 0; k < n_out; k++) { ops[k] = out[k]; if (!lead) lead = out[k]; }
  for (int k = 0; k < n_in; k++) ops[n_out + k] = in[k];
  if (!lead || dm_numel(lead) == 0) return;
  dm_dtype dt = lead->dtype;
  if (!dm_dtype_is_float(dt)) dm_error("dm.fuse '%s': no CUDA kernel for dtype %s", f->expr, dm_dtype_name(dt));
  dm_fuse_layout L;
  dm_fuse_layout_make(&L, lead->ndim, lead->shape, n_out + n_in, ops);
  fargs a;
  memset(&a, 0, sizeof a);
  a.n = dm_numel(lead);
  a.ndim = L.ndim;
  memcpy(a.shape, L.shape, sizeof a.shape);
  memcpy(a.st, L.st, sizeof a.st);
  bool flat = L.ndim == 1;
  for (int k = 0; k < n_out + n_in; k++) {
    void *p = ops[k] ? dm_data(ops[k]) : NULL;
    if (k < n_out) a.out[k] = p; else a.in[k - n_out] = p;
    if (!p) continue;
    int64_t s = L.st[k][0];
    if (k >= n_out && s == 0) a.scalar |= 1u << (k - n_out);
    else flat = flat && s == 1 && ((uintptr_t)p & 15) == 0;
  }
  if (!flat) a.scalar = 0;
  void *kernel = kernel_of(f, dir, dt, flat);
  int64_t work = flat ? a.n / (int64_t)(16 / dm_dtype_size(dt)) + 1 : a.n;
  int64_t blocks = (work + 255) / 256, cap = (int64_t)dm_cuda_sm_count() * 32;
  if (blocks > cap) blocks = cap;
  void *args[] = {&a};
  dim3 grid = {(unsigned)blocks, 1, 1}, block = {256, 1, 1};
  DM_CU(cudaLaunchKernel(kernel, grid, block, args, 0, dm_cuda_stream()));
  DM_CU_LAUNCHED();
}

static const dm_kernel_entry kernels[] = {DM_KERNEL_ENTRY(fuse, cuda_fuse)};
DM_REGISTER_KERNELS(DM_CUDA, kernels)
