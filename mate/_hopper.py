"""Hopper (sm_90a) resource limits that the stage cards' resource models check a tile candidate against."""

import contextlib
import ctypes
import functools

import torch

SMEM_PER_CTA = 227 * 1024  # the opt-in maximum of one block's shared memory
SMEM_PER_SM = 228 * 1024  # one multiprocessor's, of which 1 KB per resident block is reserved
SMEM_RESERVED_PER_CTA = 1024
REGS_PER_SM = 65536
THREADS_PER_SM = 2048
MAX_REGS = 255
WARPGROUP = 128  # wgmma is issued by warpgroups of 128 threads, each owning 64 rows of M
WGMMA_M = 64
# Query heads per KV group in the kernels that hold a group as wgmma's N (QSA sparse attention, NSA selection
# forward and backward: a group is too few rows for M = 64, so keys are M): the group is zero-padded to
# head_tile = 16 columns (N comes in multiples of 8), the one head_tile their search spaces hold.
MAX_GROUP = 16
# The FP8 KV caches the kernels read (issue 38), TileLang's names (torch's less "torch."): a compile-time option
# of the programs that take them (mqa_decode, qsa_attention_warp), each entry's tiles with each kind.
FP8_KV = ("float8_e4m3fn", "float8_e5m2")


def itemsize(dtype: str) -> int:
    """Bytes of one element of a config key's dtype name (`bfloat16`, `float32`, ...)."""
    return getattr(torch, dtype).itemsize


def warpgroups(threads: int, rows: int, what: str) -> str | None:
    """Why `threads` cannot split `rows` into whole 64-row wgmma tiles per warpgroup, or None."""
    if threads % WARPGROUP:
        return f"threads {threads} is not whole warpgroups (wgmma)"
    if rows % (WGMMA_M * (threads // WARPGROUP)):
        return f"{what} {rows} does not give each of {threads // WARPGROUP} warpgroups whole 64-row wgmma tiles"
    return None


def reduction_scratch(threads: int, columns: int) -> int:
    """Bytes of shared memory one TileLang cross-warp reduction over a [64, columns] FP32 fragment takes
    (threads x columns/4 floats; the programs that disable TileLang's buffer merging keep each one)."""
    return threads * (columns // 4) * 4


MAX_CLUSTER = 16  # CTAs of a thread-block cluster: 8 portable, up to 16 where the GPU's GPCs hold them
_PROBE_PTX = b".version 7.8\n.target sm_90\n.address_size 64\n.visible .entry mate_cluster_probe() { ret; }\n\0"


PROBE_ERROR = None  # why whole_sm_clusters last answered 0 without asking the driver


class _DriverError(RuntimeError):
    pass


# Built once per key; two first calls at once may both ask the driver (each on its own thread's context stack),
# and get the same answer.
@functools.cache
def whole_sm_clusters(index: int, cluster: int) -> int:
    """How many clusters of `cluster` CTAs that each fill an SM (227 KB of shared memory) device `index`
    runs at once: cuOccupancyMaxActiveClusters on a probe kernel, as the driver schedules them (a cluster's
    CTAs share one GPC, so this is not sms // cluster: the H200 runs 16 clusters of 6 but not of 7).
    0 where the driver holds none or cannot say (no libcuda, an old driver: PROBE_ERROR says why): no
    cluster then."""
    global PROBE_ERROR
    if not 1 <= cluster <= MAX_CLUSTER:
        return 0
    try:
        with relaxed_capture():  # a first call may come inside a CUDA graph capture
            return _max_active_clusters(index, cluster)
    except (OSError, _DriverError) as e:
        PROBE_ERROR = str(e)
        return 0


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _driver(name, *args):
    rc = getattr(_libcuda(), name)(*args)
    if rc:
        raise _DriverError(f"{name} returned CUDA error {rc}")


@contextlib.contextmanager
def relaxed_capture():
    """Inside, this thread may make the CUDA calls that a graph capture in progress forbids in its default (global)
    mode, here or in any other thread: the cluster probe's (made inside torch.cuda.graph without this, they
    invalidate the capture: H200, driver 580). Nothing of it goes into the graph; the thread's mode is restored after."""
    mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED
    _driver("cuInit", 0)
    _driver("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
    try:
        yield
    finally:
        _driver("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))


def _max_active_clusters(index: int, cluster: int) -> int:
    cuda, call = _libcuda(), _driver

    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("dims", ctypes.c_uint * 3),
                    ("rest", ctypes.c_char * 52)]

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]

    dev, ctx, mod, fn, count = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
    call("cuInit", 0)
    call("cuDeviceGet", ctypes.byref(dev), index)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)  # torch's context on that device
    try:
        call("cuCtxPushCurrent_v2", ctx)
        try:
            call("cuModuleLoadData", ctypes.byref(mod), _PROBE_PTX)
            try:
                attr = LaunchAttribute(id=4)  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.dims[:] = (cluster, 1, 1)
                cfg = LaunchConfig(smem=SMEM_PER_CTA, attrs=ctypes.pointer(attr), num_attrs=1)
                cfg.grid[:] = (cluster, 1, 1)
                cfg.block[:] = (WARPGROUP, 1, 1)
                call("cuModuleGetFunction", ctypes.byref(fn), mod, b"mate_cluster_probe")
                call("cuFuncSetAttribute", fn, 8, SMEM_PER_CTA)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                call("cuFuncSetAttribute", fn, 14, 1)  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
                call("cuOccupancyMaxActiveClusters", ctypes.byref(count), fn, ctypes.byref(cfg))
                return count.value
            finally:
                cuda.cuModuleUnload(mod)
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
