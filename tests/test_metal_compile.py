"""The fused kernels' Metal source, compiled strictly without a Mac.

Each variant is assembled as `mx.fast.metal_kernel` assembles it at its first launch (MLX's
mlx/backend/metal/custom_kernel.cpp: the prelude, our header, a generated `[[kernel]]` signature whose inputs of
fewer than 8 elements are `constant` and the others `device`, typed by their dtypes, then the attributes the body
names, then the body), and compiled by clang (libclang, the `test` extra) as C++ for OpenCL, with Metal's address
spaces mapped to OpenCL's: `device` -> __global, `constant` -> __constant, `threadgroup` -> __local, and no generic
address space, so that an unqualified pointer is a thread (private) one. Mixing address spaces (an implicit
conversion or a C-style cast between them) is then an error, as Metal's compiler makes it. A small stand-in for
metal_stdlib declares what the kernels use, with Metal's signatures. It checks the language, not Apple's code
generation: registers and compile time are measured on a Mac (docs/metal.md).
"""

from __future__ import annotations

import itertools
import re

import pytest

from tqbench.runtime import kernel_source as S
from tqbench.runtime import kernels as K

cindex = pytest.importorskip("clang.cindex", reason="the strict Metal compile needs libclang (the test extra)")

# MLX's prelude (metal_stdlib, `using namespace metal`, bfloat16_t and float16_t), as far as the kernels use it.
METAL_STANDIN = r"""
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#define device __global
#define constant __constant
#define threadgroup __local
#define thread __private
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef uint uint32_t;
typedef int int32_t;
typedef long int64_t;
typedef uint uint2 __attribute__((ext_vector_type(2)));
typedef uint uint3 __attribute__((ext_vector_type(3)));
typedef uint uint4 __attribute__((ext_vector_type(4)));
typedef float float4 __attribute__((ext_vector_type(4)));
typedef __bf16 bfloat;
namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
void threadgroup_barrier(mem_flags flags);
float simd_shuffle_xor(float data, ushort mask);
template <typename T, typename U> T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  return __builtin_bit_cast(T, x);
}
float fma(float a, float b, float c);
uint mulhi(uint a, uint b);
}  // namespace metal
using namespace metal;
// Metal's vector constructors uint4(s) and uint4(a, b, c, d)
inline uint4 metal_uint4(uint s) { return (uint4)(s); }
inline uint4 metal_uint4(uint a, uint b, uint c, uint d) { return (uint4)(a, b, c, d); }
#define uint4(...) metal_uint4(__VA_ARGS__)
typedef bfloat bfloat16_t;
typedef half float16_t;
"""

# MLX's get_type_string and the attributes metal_kernel adds when the source names them
METAL_TYPES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "uint32": "uint32_t"}
METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint", "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint", "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3", "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3",
}
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX passes inputs with fewer elements in the constant address space


def launch_inputs(spec: S.Spec, pairs: int) -> list[tuple[str, str, int, int]]:
    """(name, dtype, size, ndim) of each input a launch of `spec` over `pairs` products passes, in order."""
    xblocks = pairs if spec.gather else 1
    sizes = dict(x=("float32", xblocks * spec.batch * spec.n, 3),
                 w=("uint32", spec.experts * spec.out * spec.words, 2 + (spec.experts > 1)),
                 scales=(spec.scale_dtype, spec.experts * spec.out * (spec.n // spec.group), 2 + (spec.experts > 1)),
                 codebook=(spec.book_dtype, spec.levels, 1), indices=("uint32", pairs, 1),
                 pairs=("uint32", 2 * pairs, 2))
    return [(name, *sizes[name]) for name in S.input_names(spec)]


def mlx_metal_source(spec: S.Spec, pairs: int) -> str:
    """The source mx.fast.metal_kernel compiles for a launch of `spec`, less MLX's prelude."""
    header, body = S.kernel_source(spec, "metal")
    inputs = launch_inputs(spec, pairs)
    name = "custom_kernel_" + S.kernel_name(spec, "metal")
    for _, dtype, size, ndim in inputs:
        name += "_" + METAL_TYPES[dtype] + ("s" if ndim == 0 else "c" if size < MAX_CONSTANT_ARRAY_SIZE else "")
    name += "_float"
    params, index = [], 0
    for iname, dtype, size, ndim in inputs:
        where = "constant" if size < MAX_CONSTANT_ARRAY_SIZE else "device"
        params.append(f"  const {where} {METAL_TYPES[dtype]}{'&' if ndim == 0 else '*'} {iname} [[buffer({index})]]")
        index += 1
        for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                              ("_ndim", "const constant int&")):
            if iname + suffix in body:
                params.append(f"  {ctype} {iname}{suffix} [[buffer({index})]]")
                index += 1
    params.append(f"  device float* y [[buffer({index})]]")
    params += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES.items() if a in body]
    return header + f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {\n" + body + "\n}\n"


def as_opencl_cpp(metal: str) -> str:
    """Metal's kernel attribute as OpenCL's, its argument attributes dropped (buffer indices, thread positions)."""
    return METAL_STANDIN + re.sub(r" \[\[[a-z_]+(\(\d+\))?\]\]", "", metal.replace("[[kernel]]", "__kernel"))


CLANG_ARGS = ["-x", "cl", "-cl-std=clc++2021", "-cl-no-stdinc", "-target", "x86_64-unknown-linux-gnu",
              "-Xclang", "-cl-ext=-all,+cl_khr_fp16", "-Wall", "-Wno-unused-variable"]


def compile_errors(metal: str) -> list[str]:
    """clang's warnings and errors for the assembled Metal source, each with its line."""
    src = as_opencl_cpp(metal)
    tu = cindex.Index.create().parse("kernel.clcpp", args=CLANG_ARGS, unsaved_files=[("kernel.clcpp", src)])
    lines = src.splitlines()
    return [f"{d.spelling} (line {d.location.line}: {lines[d.location.line - 1].strip()[:120]})"
            for d in tu.diagnostics if d.severity >= cindex.Diagnostic.Warning]


DTYPES = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"), ("bfloat16", "float16")]
KINDS = {"matvec": dict(gather=False), "gather": dict(gather=True, xdiv=1), "pairs": dict(gather=True, xdiv=0)}


def variants(levels: int, kind: str):
    """(spec, pairs) over batches 1..4, the dtypes, Metal's and the H200's layouts, 32- and 64-bit offsets, and
    index arrays and scales small enough to be `constant`."""
    for batch, (sd, bd), backend in itertools.product(range(1, 5), DTYPES, ("metal", "cuda")):
        pairs = 3 if batch % 2 else 16  # 3 experts: indices (and, at 1 row, pairs) are constant
        n, out, experts = (896, 48, 6) if kind != "matvec" else ((32, 4, 1) if batch == 1 else (7168, 3072, 1))
        yield K.make_spec(levels, 32, n, out, experts, batch, pairs=pairs, scale_dtype=sd, book_dtype=bd,
                          backend=backend, wide=True if backend == "cuda" else None, **KINDS[kind]), pairs


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("levels", S.LEVELS)
def test_every_metal_variant_compiles_strictly(levels, kind) -> None:
    failed = {}
    seen = 0
    for spec, pairs in variants(levels, kind):
        metal = mlx_metal_source(spec, pairs)
        seen += 1
        if errors := compile_errors(metal):
            what = f"batch {spec.batch} {spec.scale_dtype}/{spec.book_dtype} rows {spec.rows} wide {spec.wide}"
            failed[what] = errors
    assert seen == 32 and not failed, failed


def test_small_inputs_are_constant_and_the_signature_is_mlx_s() -> None:
    """3- and 4-level codebooks, 3 experts' indices and a 4-row product's scales arrive in the constant space."""
    spec = K.make_spec(4, 32, 32, 4, 1, 1, True, "bfloat16", "float16", pairs=3, xdiv=1, backend="metal")
    metal = mlx_metal_source(spec, 3)
    assert ("  const device float* x [[buffer(0)]],\n  const device uint32_t* w [[buffer(1)]],\n"
            "  const constant bfloat16_t* scales [[buffer(2)]],\n  const constant float16_t* codebook [[buffer(3)]],\n"
            "  const constant uint32_t* indices [[buffer(4)]],\n  device float* y [[buffer(5)]],\n"
            "  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],\n"
            "  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {\n") in metal
    assert "_float_uint32_t_bfloat16_tc_float16_tc_uint32_tc_float(" in metal
    assert compile_errors(metal) == []
    big = mlx_metal_source(K.make_spec(16, 32, 896, 48, 6, 1, True, pairs=16, xdiv=1, backend="metal"), 16)
    assert "const device float16_t* codebook" in big and "const device uint32_t* indices" in big


@pytest.mark.parametrize("levels,old,new,why", [
    (16, "#define TQ_CDEV const device", "#define TQ_CDEV const", "converts between mismatching address spaces"),
    (4, "float(codebook[tid])", "((const device float16_t*)codebook)[tid]", "mismatching address spaces"),
    (8, "metal::fma((a), (b), (c))", "metal::fma((a), (b))", "too few arguments"),
    (3, "as_type<float>((v))", "as_type<float>((ushort)(v))", "as_type: sizes differ"),
])
def test_the_compile_rejects_what_metal_would(levels, old, new, why) -> None:
    """The check is not vacuous: a pointer that loses its address space, a `constant` input read as `device`, a
    wrong call, a bit cast between sizes are each an error here as in Metal's compiler."""
    spec = K.make_spec(levels, 32, 896, 48, 1, 2, False, backend="metal")
    metal = mlx_metal_source(spec, 1)
    assert old in metal and compile_errors(metal) == []
    errors = compile_errors(metal.replace(old, new))
    assert errors and any(why in e for e in errors), errors


def test_a_size_past_32_bit_offsets_takes_the_64_bit_variant() -> None:
    """K3's 384 experts of 7168 x 3072 fit 32-bit offsets on Metal; 1024 experts of 8192 x 8192 at 4 bits (8.6e9
    words) do not, and get the 64-bit variant; CUDA keeps 64-bit offsets, as measured."""
    k3 = K.make_spec(16, 64, 3072, 7168, 384, 1, True, xdiv=1, backend="metal")
    big = K.make_spec(16, 64, 8192, 8192, 1024, 1, True, xdiv=1, backend="metal")
    assert k3.offsets_fit_32 and not big.offsets_fit_32
    assert S.offset_type(k3, "metal") == "tq_u32" and S.offset_type(big, "metal") == "tq_u64"
    assert S.offset_type(k3, "cuda") == "tq_u64"
    k3_src, big_src = (S.kernel_source(s, "metal")[1] for s in (k3, big))
    assert "tq_u32 wrow[TQ_R];" in k3_src and "tq_u64 wrow[TQ_R];" in big_src
    assert "mulhi(f, 3u)" in S.kernel_source(K.make_spec(3, 64, 3072, 7168, 1, 1, False), "metal")[0]
    with pytest.raises(ValueError, match="need 64-bit offsets"):
        K.make_spec(16, 64, 8192, 8192, 1024, 1, True, xdiv=1, wide=False)
    assert compile_errors(mlx_metal_source(big, 16)) == []
