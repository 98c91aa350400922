"""Fused TurboQuant kernels: the template's source for both dialects (tqbench.runtime.kernel_source), its arithmetic
(ternary fixed-point digits), the kernels themselves run on the CPU through a small C++ emulation of CUDA and Metal
(one std::thread per GPU thread; needs g++), and the dispatch (tqbench.runtime.kernels) with its one-time self-check
and fallback."""

from __future__ import annotations

import hashlib
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tqbench.quant.turboquant import codebook as published_codebook
from tqbench.runtime import codebook as ref
from tqbench.runtime import kernel_source as S
from tqbench.runtime import kernels as K

# ---------------------------------------------------------------------------------------------------------------
# The template's source
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
@pytest.mark.parametrize("levels,per,bits", [(3, 20, 0), (4, 16, 2), (8, 10, 3), (16, 8, 4)])
def test_source_has_the_format_constants(dialect, levels, per, bits) -> None:
    spec = K.make_spec(levels, 64, 7168, 3072, 1, 1, False)
    header, body = S.kernel_source(spec, dialect)
    src = header + body
    words = -(-7168 // per)
    assert f"#define TQ_PER {per}\n" in header
    assert f"#define TQ_WORDS {words}\n" in header
    assert f"{per} codes per word, {words} words per row" in body
    assert f"#define TQ_UNIT {S.unit_codes(levels)}u\n" in header
    assert f"#define TQ_BLOCKS {S.unit_codes(levels) // 32}\n" in header
    if levels == 3:
        # powers of 3 for the digit runs, up to 3^20 > 2^31, and the fixed-point constants of a 10-trit run
        assert "case 5: return 243u;" in header and "case 20: return 3486784401u;" in header
        assert f"case 10: return {(1 << 32) // 3**10}u;" in header  # K = floor(2^32 / 3^10) = 72735
        assert "#define TQ_TRIT_MAGIC 1258291200u" in header  # 0x4B000000, the float 2^23
        assert "8388609.0f" in header  # 2^23 + 1: the trit t becomes t - 1 in {-1, 0, 1}
        assert "tab[" not in body  # ternary decodes arithmetically, no table
    else:
        assert f"#define TQ_MASK {(1 << bits) - 1}u\n" in header
        assert f"#define TQ_BITS {bits}\n" in header
        assert f"if (tid < {levels}u) tab[tid]" in body
    if dialect == "cuda":
        assert "__shfl_xor_sync(0xffffffffu, acc[r][b], o)" in body
        assert "blockIdx.x" in body and "threadIdx.x" in body
        assert "__half2float((v))" in header
        assert "thread_position_in_threadgroup" not in src and "simd_" not in src
        if levels != 3:
            assert "__shared__ float tab[16];" in body and "__syncthreads();" in body
    else:
        assert "simd_shuffle_xor(acc[r][b], (ushort)(o))" in body
        assert "threadgroup_position_in_grid.x" in body and "thread_position_in_threadgroup.x" in body
        assert "const device uint4*" in header and "as_type<float>((v))" in header
        assert "__shfl" not in src and "__shared__" not in src and "blockIdx" not in src
        if levels != 3:
            assert "threadgroup float tab[16];" in body
            assert "threadgroup_barrier(mem_flags::mem_threadgroup);" in body
    # the same template: the dialects differ only in spellings, never in the algorithm's constants
    other = S.kernel_source(spec, "metal" if dialect == "cuda" else "cuda")[0]
    defines = lambda h: [ln for ln in h.splitlines() if ln.startswith("#define TQ_") and "H2F" not in ln
                         and "U2F" not in ln and "CDEV" not in ln and "TQ_LOAD" not in ln
                         and "TQ_FMA" not in ln]
    assert defines(header) == defines(other)


def test_source_is_small_and_names_are_unique() -> None:
    """MLX copies the whole source on every call of a custom kernel: it must stay a few kB."""
    for levels in S.LEVELS:
        for dialect in ("cuda", "metal"):
            header, body = S.kernel_source(K.make_spec(levels, 32, 7168, 3072, 16, 4, True, xdiv=1), dialect)
            assert len(header) + len(body) < 12_000
    a = S.kernel_name(K.make_spec(8, 64, 4096, 7168, 1, 1, False), "cuda")
    b = S.kernel_name(K.make_spec(8, 64, 4096, 7168, 1, 2, False), "cuda")
    c = S.kernel_name(K.make_spec(8, 64, 4096, 7168, 1, 1, False, lanes=16), "cuda")
    assert len({a, b, c}) == 3 and a.startswith("tq_matvec_l8_g64_n4096_o7168_b1_")


def test_spec_refuses_what_the_kernel_cannot_do() -> None:
    with pytest.raises(ValueError):
        K.make_spec(5, 64, 4096, 64, 1, 1, False)
    with pytest.raises(ValueError):
        K.make_spec(8, 48, 4096, 64, 1, 1, False)
    with pytest.raises(ValueError):
        K.make_spec(8, 64, 4096, 62, 1, 1, False)  # 3-bit rows tiles start at multiples of 4 rows
    assert K.make_spec(16, 64, 4096, 62, 1, 1, False).out == 62  # 4-bit rows are always aligned
    with pytest.raises(ValueError, match="at most 256"):
        K.make_spec(3, 64, 4096, 64, 1, 1, False, tiles=2)  # 5 warps a tile group: 320 threads
    for levels in S.LEVELS:  # the defaults always fit
        for n, out in ((7168, 3072), (3072, 7168), (896, 48)):
            assert K.make_spec(levels, 64, n, out, 1, 4, False).threads <= 256


def test_layout_keeps_lanes_busy() -> None:
    # 3-bit / ternary units hold 160 codes; the lanes of a row tile walk a row's units
    assert K.choose_layout(3, 3072, 3584)["lanes"] == 8  # 20 units: 8 lanes -> 20/24 busy, 16 -> 20/32
    assert K.choose_layout(3, 7168, 3072)["lanes"] == 8  # 45 units: 45/48 either way, fewer lanes win
    assert K.choose_layout(8, 7168, 3072) == {"rows": 4, "lanes": 4, "tiles": 1}
    assert K.choose_layout(16, 7168, 4096) == {"rows": 8, "lanes": 16, "tiles": 4}
    assert K.choose_layout(16, 256, 64) == {"rows": 8, "lanes": 8, "tiles": 4}  # 8 units a row


# ---------------------------------------------------------------------------------------------------------------
# Ternary arithmetic: every run of up to 10 trits comes out exactly
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", range(1, 11))
def test_trit_fixed_point_is_exact_for_every_value(count) -> None:
    k, c = S.trit_constants(count)
    p = 3**count
    v = np.arange(p, dtype=np.uint64)
    f = v * np.uint64(k) + np.uint64(c)
    assert int(f.max()) < 2**32  # never overflows
    for i in range(count):
        prod = f * np.uint64(3)
        got = prod >> np.uint64(32)
        f = prod & np.uint64(0xFFFFFFFF)
        np.testing.assert_array_equal(got, (v // 3 ** (count - 1 - i)) % 3)


def test_trit_digits_of_packed_words() -> None:
    rng = np.random.default_rng(3)
    trits = rng.integers(0, 3, (64, 20))
    words = (trits * 3 ** np.arange(20)).sum(1)
    for w, t in zip(words.tolist(), trits.tolist()):
        for start, count in ((0, 10), (10, 10), (12, 8), (0, 4), (4, 10)):
            assert S.trit_digits(w, start, count) == t[start:start + count][::-1]
    assert S.trit_digits(3**20 - 1, 10, 10) == [2] * 10  # all-2 runs (the fixed point's edge)


# ---------------------------------------------------------------------------------------------------------------
# The kernels, emulated on the CPU
# ---------------------------------------------------------------------------------------------------------------

_SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>
struct Dim3 { unsigned x, y, z; };
static thread_local Dim3 threadIdx, blockIdx, thread_position_in_threadgroup, threadgroup_position_in_grid;
static std::barrier<>* g_block_bar;
struct Warp { std::barrier<> bar{32}; float vals[32]; };
static std::vector<std::unique_ptr<Warp>> g_warps;
struct uint4 { unsigned x, y, z, w; uint4() = default; uint4(unsigned a) : x(a), y(a), z(a), w(a) {}
  uint4(unsigned a, unsigned b, unsigned c, unsigned d) : x(a), y(b), z(c), w(d) {} };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
typedef unsigned short ushort;  // uint and ulong (64-bit) come from sys/types.h
static float h2f_bits(uint16_t h) {
  uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023; float v;
  if (e == 0) v = std::ldexp((float)m, -24); else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp((float)(m | 1024), (int)e - 25);
  return s ? -v : v; }
struct __half { uint16_t bits; };
struct half { uint16_t bits; operator float() const { return h2f_bits(bits); } };
static inline float __half2float(__half h) { return h2f_bits(h.bits); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
template <typename T> static inline T as_type(unsigned u) { T f; std::memcpy(&f, &u, 4); return f; }
using std::fma;
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline unsigned mulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
namespace metal { using std::fma; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
namespace mem_flags { enum { mem_threadgroup }; }
static inline void threadgroup_barrier(int) { g_block_bar->arrive_and_wait(); }
static inline float shfl_xor_impl(float v, unsigned o) {
  unsigned t = thread_position_in_threadgroup.x; Warp& W = *g_warps[t / 32];
  W.vals[t % 32] = v; W.bar.arrive_and_wait(); float r = W.vals[(t % 32) ^ o]; W.bar.arrive_and_wait(); return r; }
static inline float __shfl_xor_sync(unsigned, float v, unsigned o) { return shfl_xor_impl(v, o); }
static inline float simd_shuffle_xor(float v, ushort o) { return shfl_xor_impl(v, o); }
#define __device__
#define __forceinline__
#define device
#define threadgroup static
#define __shared__ static
"""

_DRIVER = r"""
template <typename T> static std::vector<T> rd(const char* dir, const char* name) {
  std::string p = std::string(dir) + "/" + name; FILE* f = fopen(p.c_str(), "rb"); std::vector<T> v;
  if (!f) return v; fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET); v.resize(n / sizeof(T));
  if (fread(v.data(), 1, n, f) != (size_t)n) v.clear(); fclose(f); return v; }
int main(int argc, char** argv) {
  const char* dir = argv[1]; unsigned gx = atoi(argv[2]), gy = atoi(argv[3]), nt = atoi(argv[4]); long ny = atol(argv[5]);
  auto x = rd<float>(dir, "x"); auto w = rd<uint32_t>(dir, "w"); auto s = rd<uint16_t>(dir, "s");
  auto cb = rd<uint16_t>(dir, "cb"); auto sel = rd<uint32_t>(dir, "sel");
  std::vector<float> y(ny, NAN);  // poisoned: every output must be written
  for (unsigned by = 0; by < gy; ++by) for (unsigned bx = 0; bx < gx; ++bx) {
    std::barrier<> bar(nt); g_block_bar = &bar; g_warps.clear();
    for (unsigned i = 0; i < (nt + 31) / 32; ++i) g_warps.emplace_back(new Warp());
    std::vector<std::thread> th;
    for (unsigned t = 0; t < nt; ++t) th.emplace_back([&, t] {
      threadIdx = thread_position_in_threadgroup = Dim3{t, 0, 0};
      blockIdx = threadgroup_position_in_grid = Dim3{bx, by, 0};
      kern(x.data(), w.data(), (const HALF*)s.data(), (const HALF*)cb.data(), SEL y.data()); });
    for (auto& t : th) t.join();
  }
  std::string p = std::string(dir) + "/y"; FILE* f = fopen(p.c_str(), "wb"); fwrite(y.data(), 4, ny, f); fclose(f);
  return 0; }
"""

_EMU_DIR = Path(tempfile.gettempdir()) / "tqbench-kernel-emu"
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel emulation needs g++")


def _emulator(spec: S.Spec, dialect: str, broken: bool = False) -> Path:
    """CUDA: the whole NVRTC program (`cuda_program`: prelude, 16-bit widening, parameter list); Metal: the body inside
    a function with mx.fast.metal_kernel's parameters. `broken`: the source with a syntax error (a build that fails)."""
    if dialect == "cuda":
        src = (_SHIM + "#define __global__\n" + S.cuda_program(spec, "kern")
               + _DRIVER.replace("HALF", "tq_half").replace("SEL", "sel.data()," if spec.gather else ""))
    else:
        header, body = S.kernel_source(spec, dialect)
        params = "const device float* x, const device uint32_t* w, const device half* scales, "
        params += "const device half* codebook, "
        if spec.gather:
            params += f"const device uint32_t* {'indices' if spec.xdiv else 'pairs'}, "
        params += "device float* y"
        src = (_SHIM + header + f"\nstatic void kern({params}) {{\n{body}}}\n"
               + _DRIVER.replace("HALF", "half").replace("SEL", "sel.data()," if spec.gather else ""))
    if broken:
        src = src.replace("const tq_u32 tid =", "const tq_u32 tid = = ")
    _EMU_DIR.mkdir(exist_ok=True)
    exe = _EMU_DIR / hashlib.sha1(src.encode()).hexdigest()[:16]
    if not exe.exists():
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(src)
        tmp = exe.with_suffix(f".{os.getpid()}")
        subprocess.run(["g++", "-std=c++20", "-O0", "-pthread", "-w", "-o", str(tmp), str(cpp)], check=True,
                       stderr=subprocess.DEVNULL if broken else None)
        tmp.replace(exe)
    return exe


def _emulated(dialect: str, broken=lambda spec: False):
    """A stand-in for K.compiled: a callable with mx.fast kernels' call signature that runs the emulation (built from
    a broken source for the specs `broken` names)."""

    def compiled(spec: S.Spec, backend: str):
        exe = _emulator(spec, dialect, broken(spec))

        def call(inputs, grid, threadgroup, output_shapes, output_dtypes):
            x, w, s, cb = (np.array(a) for a in inputs[:4])
            with tempfile.TemporaryDirectory() as d:
                x.astype(np.float32).tofile(f"{d}/x")
                w.astype(np.uint32).tofile(f"{d}/w")
                s.astype(np.float16).view(np.uint16).tofile(f"{d}/s")
                cb.astype(np.float16).view(np.uint16).tofile(f"{d}/cb")
                if spec.gather:
                    np.array(inputs[4]).astype(np.uint32).tofile(f"{d}/sel")
                ny = math.prod(output_shapes[0])
                subprocess.run([str(exe), d, str(grid[0] // threadgroup[0]), str(grid[1]), str(threadgroup[0]),
                                str(ny)], check=True)
                return [mx.array(np.fromfile(f"{d}/y", np.float32).reshape(output_shapes[0]))]

        return call

    return compiled


def _rel(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _case(levels, group, n, out, experts=1, key=0, symmetric=False):
    w, s, cb = K.random_case(levels, group, n, out, experts, key=key)
    if symmetric:
        cb = mx.array(published_codebook({3: "T", 4: "2", 8: "3", 16: "4"}[levels]))
    return w, s, cb


@needs_gxx
def test_cuda_prelude_widens_every_16_bit_pattern_exactly(tmp_path) -> None:
    """The NVRTC program's own float16 / bfloat16 widening (its integer path, compiled here by g++) against numpy, bit
    for bit over all 65,536 patterns (NaNs compared as NaN)."""
    src = ("#include <cstdio>\n#include <cstring>\n#define __device__\n#define __forceinline__\n"
           "static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }\n"
           + S._CUDA_PRELUDE +
           "int main() { for (unsigned b = 0; b < 65536u; ++b) {"
           " tq_half h{(unsigned short)b}; tq_bf16 g{(unsigned short)b};"
           " float v[2] = {tq_half2float(h), tq_bf162float(g)}; fwrite(v, 4, 2, stdout); } return 0; }\n")
    (tmp_path / "p.cpp").write_text(src)
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "p"), str(tmp_path / "p.cpp")], check=True)
    got = np.frombuffer(subprocess.run([str(tmp_path / "p")], capture_output=True, check=True).stdout,
                        np.float32).reshape(-1, 2)
    bits = np.arange(65536, dtype=np.uint32)
    want_half = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    want_bf16 = (bits << 16).view(np.float32)
    for g, w in ((got[:, 0], want_half), (got[:, 1], want_bf16)):
        nan = np.isnan(w)
        assert np.array_equal(np.isnan(g), nan)
        assert np.array_equal(g[~nan].view(np.uint32), w[~nan].view(np.uint32))


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="needs a machine without a CUDA driver")
def test_without_nvrtc_or_a_driver_mlx_builds_the_cuda_kernels(monkeypatch, capsys) -> None:
    """Where the NVRTC build cannot run (here: no CUDA driver), the reason is kept and said once, and MLX's own
    cuda_kernel builds every kernel from then on (on this CPU build of MLX that refuses too: no CUDA back-end)."""
    monkeypatch.setattr(K, "NVRTC_ERROR", None)
    monkeypatch.setattr(K.dispatcher, "warnings", [])
    with pytest.raises(RuntimeError, match="No CUDA back-end"):
        K.compiled(K.make_spec(8, 64, 896, 48, 1, 1, False), "cuda")
    assert K.NVRTC_ERROR is not None and "libcuda" in K.NVRTC_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tqbench: NVRTC cannot build the CUDA kernels (OSError: ")
    assert K.dispatcher.warnings == [err.strip()]  # kept with the self-checks' warnings

    def never(spec):
        raise AssertionError("NVRTC tried again")

    monkeypatch.setattr(K, "_precompiled", never)
    with pytest.raises(RuntimeError, match="No CUDA back-end"):
        K.compiled(K.make_spec(8, 64, 896, 48, 1, 2, False), "cuda")
    assert capsys.readouterr().err == ""  # said once


def test_mlx_keeps_its_cuda_kernels_in_tqbench_cache_unless_the_user_chose(tmp_path) -> None:
    """MLX reads MLX_PTX_CACHE_DIR at its first run-time compile: loading a model and starting a conversion point it at
    a folder per MLX version under tqbench's cache (MLX's default, /tmp, is emptied by a reboot), even when they then
    fail; importing tqbench alone does not; a user's choice is left alone."""
    code = ("import os, tqbench.runtime.load as L, tqbench.convert as C\n"
            "from tqbench.recipe import Recipe\n"
            "print(os.environ.get('MLX_PTX_CACHE_DIR'))\n"
            "for call in (lambda: L.load('/no/such/model'), lambda: next(C.convert('/no/such', '/tmp/x', "
            "Recipe.parse('tq4')))):\n"
            "    try:\n        call()\n    except Exception:\n        pass\n"
            "    print(os.environ.get('MLX_PTX_CACHE_DIR'))\n"
            "    os.environ.pop('MLX_PTX_CACHE_DIR', None) if os.environ.get('USER_SET') is None else None\n")
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["TQBENCH_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    ours = str(tmp_path / "cache" / "cuda" / f"mlx-{mx.__version__}" / "ptx")
    assert out.split() == ["None", ours, ours]  # not at import; by load, then (unset again) by convert
    env.update(MLX_PTX_CACHE_DIR=str(tmp_path / "mine"), USER_SET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(tmp_path / "mine")] * 3


def test_a_compiled_cubin_is_kept_whole_and_read_back(tmp_path, monkeypatch) -> None:
    """tqbench.cubin writes each cubin into the cache directory atomically (no temporary file stays) and a later call
    reads it instead of compiling again (NVRTC and the driver stood in for)."""
    from tqbench import cubin

    sources = []

    def compile_cubin(source, arch, filename):
        sources.append(source)
        return f"{arch}: {source}".encode()

    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cubin, "architecture", lambda: "sm_90")
    monkeypatch.setattr(cubin, "_nvrtc_version", lambda: "12.8")
    monkeypatch.setattr(cubin, "compile_cubin", compile_cubin)
    monkeypatch.setattr(cubin, "STATS", cubin.CompileStats())
    name, data = cubin.cached_cubin("tq_k", lambda nm: f"kernel {nm}")
    assert name.startswith("tq_k_") and data == f"sm_90: kernel {name}".encode()
    assert [p.name for p in (tmp_path / "cuda").iterdir()] == [f"{name}.cubin"]
    assert cubin.cached_cubin("tq_k", lambda nm: f"kernel {nm}") == (name, data)
    assert len(sources) == 1 and (cubin.STATS.compiled, cubin.STATS.loaded) == (1, 1)


def test_cuda_program_takes_the_inputs_in_order_and_16_bit_types() -> None:
    spec = K.make_spec(3, 64, 896, 48, 6, 1, True, "bfloat16", "float32", pairs=6, xdiv=3)
    src = S.cuda_program(spec, "tq_k")
    assert ('extern "C" __global__ void tq_k(const float* x, const tq_u32* w, const tq_bf16* scales, '
            'const float* codebook, const tq_u32* indices, float* y)') in src
    assert S.input_names(spec) == ["x", "w", "scales", "codebook", "indices"]
    plain = K.make_spec(8, 64, 896, 48, 1, 2, False)
    assert "void tq_k(const float* x, const tq_u32* w, const tq_half* scales, const tq_half* codebook, float* y)" \
        in S.cuda_program(plain, "tq_k")
    assert "#include" not in src  # NVRTC compiles it with no include paths


@needs_gxx
@pytest.mark.parametrize("dialect", ["cuda", "metal"])
@pytest.mark.parametrize("levels", [3, 4, 8, 16])
def test_emulated_matvec_matches_reference(monkeypatch, dialect, levels) -> None:
    """n=896: 3-bit rows of 90 words and ternary rows of 45 (misaligned), 5.6 units of 160 codes (a partial one)."""
    monkeypatch.setattr(K, "compiled", _emulated(dialect))
    group = {3: 64, 4: 32, 8: 128, 16: 64}[levels]
    w, s, cb = _case(levels, group, 896, 48, key=levels)
    for rows in (1, 3):
        x = mx.random.normal((rows, 896), key=mx.random.key(rows))
        got = K.fused_matmul(x, w[0], s[0], cb, dialect)
        want = ref.matmul(x, w[0], s[0], cb)
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5


@needs_gxx
@pytest.mark.parametrize("levels", [3, 8])
def test_emulated_symmetric_codebook_and_row_misalignment(monkeypatch, levels) -> None:
    """The published (symmetric) codebooks take the ternary fast path; n=384 gives 3-bit rows of 39 words
    (every misalignment 0..3 within a tile) and 6 rows of W per tile tail."""
    monkeypatch.setattr(K, "compiled", _emulated("cuda"))
    w, s, cb = _case(levels, 128, 384, 44, key=9, symmetric=True)
    x = mx.random.normal((2, 384), key=mx.random.key(5))
    assert _rel(K.fused_matmul(x, w[0], s[0], cb, "cuda"), ref.matmul(x, w[0], s[0], cb)) < 1e-5


@needs_gxx
@pytest.mark.parametrize("levels", [3, 16])
def test_emulated_gather_matches_reference(monkeypatch, levels) -> None:
    """SwitchGLU's two shapes (x shared by a token's experts; x per expert) and a general broadcast (explicit
    pairs), with 6 rows of x split over two launches."""
    monkeypatch.setattr(K, "compiled", _emulated("metal" if levels == 3 else "cuda"))
    w, s, cb = _case(levels, 32, 640, 40, experts=5, key=2)
    idx = mx.array([[4, 0, 2], [1, 1, 3]], dtype=mx.uint32)
    for xshape in ((2, 1, 1, 640), (2, 3, 1, 640), (1, 3, 1, 640), (2, 3, 6, 640)):
        x = mx.random.normal(xshape, key=mx.random.key(len(xshape) + xshape[1]))
        got = K.fused_gather(x, w, s, cb, idx, "x")
        want = ref.gather_matmul(x, w, s, cb, idx)
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5, xshape
    assert K._x_divisor((2, 1), (2, 3)) == 3 and K._x_divisor((2, 3), (2, 3)) == 1
    assert K._x_divisor((1, 3), (2, 3)) == 0 and K._x_divisor((1, 1), (2, 3)) == 6


@needs_gxx
@pytest.mark.parametrize("levels", [3, 16])
def test_emulated_gather_at_the_most_routings_the_dispatcher_sends(monkeypatch, levels) -> None:
    """The largest gathered product the fused kernel serves: 8 prompt tokens at top-16, sorted by expert as mlx-lm's
    SwitchGLU sorts 64 routings and more (x (128, 1, n), indices (128,)), many routings per expert, a pool of 130."""
    monkeypatch.setattr(K, "compiled", _emulated("cuda"))
    w, s, cb = _case(levels, 32, 256, 12, experts=130, key=31)
    idx = np.sort(np.concatenate([np.full(40, 7), np.full(30, 129), np.random.default_rng(3).integers(0, 130, 58)]))
    x = mx.random.normal((128, 1, 256), key=mx.random.key(9))
    indices = mx.array(idx.astype(np.uint32))
    d = K.Dispatcher(backend="cuda")
    assert d.fits_gather(1, 128, 256, w, s, cb) and not d.fits_gather(1, 129, 256, w, s, cb)
    got = K.fused_gather(x, w, s, cb, indices, "cuda")
    with mx.stream(mx.cpu):
        want = ref.gather_matmul(x, w, s, cb, indices, True)
    assert got.shape == want.shape == (128, 1, 12)
    assert _rel(got, want) < 1e-5


@needs_gxx
@pytest.mark.parametrize("levels,layout", [(16, dict(rows=1, lanes=8, tiles=2)), (16, dict(rows=2, lanes=16, tiles=1)),
                                           (16, dict(rows=8, lanes=32, tiles=3)), (8, dict(rows=8, lanes=4, tiles=1)),
                                           (3, dict(rows=8, lanes=8, tiles=1)), (3, dict(rows=4, lanes=4, tiles=1)),
                                           (3, dict(prefetch=True, xpre=True)), (8, dict(prefetch=False))])
def test_emulated_layouts(monkeypatch, levels, layout) -> None:
    """Other layouts; out=44 leaves a tile of 8 rows half past the last row."""
    monkeypatch.setattr(K, "compiled", _emulated("cuda"))
    w, s, cb = _case(levels, 32, 640, 44, key=4)
    x = mx.random.normal((2, 640), key=mx.random.key(1))
    assert _rel(K.fused_matmul(x, w[0], s[0], cb, "cuda", **layout), ref.matmul(x, w[0], s[0], cb)) < 1e-5


@needs_gxx
def test_emulated_metal_layouts_split_batches_and_64_bit_offsets(monkeypatch) -> None:
    """Metal's own layouts: ternary takes 3 rows of x a launch (4 rows: launches of 3 and 1, plain and gathered), 4-bit
    4 rows per lane from 2 rows of x; and the 64-bit offset variant computes the same products."""
    monkeypatch.setattr(K, "compiled", _emulated("metal"))
    for levels in (3, 16):
        w, s, cb = _case(levels, 64, 896, 48, key=levels + 20)
        x = mx.random.normal((4, 896), key=mx.random.key(12))
        want = ref.matmul(x, w[0], s[0], cb)
        specs = K.matmul_specs(4, levels, 64, 896, 48, "float16", "float16", "metal")
        assert [(sp.batch, sp.rows) for sp in specs] == ([(3, 4), (1, 4)] if levels == 3 else [(4, 4)])
        assert _rel(K.fused_matmul(x, w[0], s[0], cb, "metal"), want) < 1e-5
        assert _rel(K.fused_matmul(x, w[0], s[0], cb, "metal", wide=True), want) < 1e-5
    w, s, cb = _case(3, 32, 640, 40, experts=5, key=2)
    idx = mx.array([[4, 0, 2], [1, 1, 3]], dtype=mx.uint32)
    x = mx.random.normal((2, 3, 4, 640), key=mx.random.key(15))  # 4 rows of x per pair: launches of 3 and 1
    assert _rel(K.fused_gather(x, w, s, cb, idx, "metal"), ref.gather_matmul(x, w, s, cb, idx)) < 1e-5


@needs_gxx
def test_a_kernel_that_fails_to_build_on_first_use_falls_back_with_one_warning(monkeypatch) -> None:
    """The self-check builds the kernels of 1 and 3 rows of x; a product of 2 rows needs another, which here fails to
    build (its source broken for the test). That shape gets the reference path, with one warning line, however often
    it comes; the checked shapes keep the fused kernel."""
    monkeypatch.setattr(K, "compiled", _emulated("metal", broken=lambda spec: spec.batch == 2))
    stream = io.StringIO()
    d = K.Dispatcher(backend="metal", stream=stream)
    w, s, cb = _case(16, 64, 896, 48, key=3)
    x2 = mx.random.normal((2, 896), key=mx.random.key(13))
    for _ in range(3):
        assert mx.array_equal(d.matmul(x2, w[0], s[0], cb), ref.matmul(x2, w[0], s[0], cb))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and d.warnings == lines
    assert lines[0].startswith("tqbench: fused TurboQuant kernel failed on first use on metal (matmul, 16 levels, "
                               "group 64, float16, 896 -> 48, 2 rows of x: CalledProcessError: Command ")
    assert lines[0].endswith("); this shape uses the reference path")
    x1 = mx.random.normal((1, 896), key=mx.random.key(14))
    got = d.matmul(x1, w[0], s[0], cb)
    assert _rel(got, ref.matmul(x1, w[0], s[0], cb)) < 1e-5 and not mx.array_equal(got, ref.matmul(x1, w[0], s[0], cb))
    assert len(stream.getvalue().splitlines()) == 1
    assert all(d.checked.values()) and list(d.shapes.values()) == [False, True]


# ---------------------------------------------------------------------------------------------------------------
# Dispatch and self-check
# ---------------------------------------------------------------------------------------------------------------


def _inputs(levels=8, group=64, n=896, out=48, experts=6):
    w, s, cb = K.random_case(levels, group, n, out, experts, key=11)
    return w, s, cb


def test_cpu_uses_the_reference_exactly() -> None:
    assert K.default_backend() is None  # this machine: the default device is the CPU
    w, s, cb = _inputs()
    x = mx.random.normal((2, 896), key=mx.random.key(0))
    assert mx.array_equal(K.matmul(x, w[0], s[0], cb), ref.matmul(x, w[0], s[0], cb))
    x = mx.random.normal((1, 1, 1, 896), key=mx.random.key(1))
    idx = mx.array([[3, 1]], dtype=mx.uint32)
    assert mx.array_equal(K.gather_matmul(x, w, s, cb, idx), ref.gather_matmul(x, w, s, cb, idx))
    assert mx.array_equal(K.gather_matmul(x, w, s, cb, idx, True), ref.gather_matmul(x, w, s, cb, idx, True))


class _Kernel:
    """A stand-in fused kernel: `fn` computes the result; records its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _good_matmul(x, w, s, cb, backend):
    return ref.matmul(x, w, s, cb) + 0.0


def _good_gather(x, w, s, cb, idx, backend):
    return ref.gather_matmul(x, w, s, cb, idx)


def test_a_kernel_that_passes_its_self_check_is_used() -> None:
    stream = io.StringIO()
    mm, gm = _Kernel(_good_matmul), _Kernel(_good_gather)
    d = K.Dispatcher(backend="test", matmul_kernel=mm, gather_kernel=gm, stream=stream)
    w, s, cb = _inputs()
    x = mx.random.normal((1, 896), key=mx.random.key(2))
    y = d.matmul(x, w[0], s[0], cb)
    assert mm.calls == 3  # the self-check's two cases, then this product
    assert mx.allclose(y, ref.matmul(x, w[0], s[0], cb), rtol=1e-6, atol=1e-6)
    d.matmul(x, w[1], s[1], cb)
    assert mm.calls == 4  # checked once per configuration
    xg = mx.random.normal((1, 1, 1, 896), key=mx.random.key(3))
    idx = mx.array([[0, 5]], dtype=mx.uint32)
    d.gather_matmul(xg, w, s, cb, idx)
    assert gm.calls == 2 and stream.getvalue() == "" and d.warnings == []
    assert all(d.checked.values()) and len(d.checked) == 2


def test_a_wrong_kernel_falls_back_with_one_warning() -> None:
    stream = io.StringIO()
    wrong = _Kernel(lambda x, w, s, cb, backend: ref.matmul(x, w, s, cb) * 1.001)  # 1e-3 off
    d = K.Dispatcher(backend="metal", matmul_kernel=wrong, stream=stream)
    w, s, cb = _inputs(levels=16, group=32)
    x = mx.random.normal((2, 896), key=mx.random.key(4))
    for _ in range(3):
        y = d.matmul(x, w[0], s[0], cb)
        assert mx.array_equal(y, ref.matmul(x, w[0], s[0], cb))  # the reference, exactly
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("tqbench: fused TurboQuant kernel failed its self-check on metal (matmul, 16 levels, "
                               "group 32, float16: relative error 0.001")
    assert lines[0].endswith("; using the reference path")
    assert wrong.calls == 2  # the self-check's two cases; never run again


def test_a_kernel_that_raises_falls_back_with_one_warning() -> None:
    stream = io.StringIO()

    def boom(*args, **kwargs):
        raise RuntimeError("Failed to compile kernel: something\nmore lines")

    d = K.Dispatcher(backend="cuda", gather_kernel=_Kernel(boom), stream=stream)
    w, s, cb = _inputs(levels=3, group=128)
    x = mx.random.normal((1, 1, 1, 896), key=mx.random.key(5))
    idx = mx.array([[2, 4]], dtype=mx.uint32)
    for _ in range(2):
        assert mx.array_equal(d.gather_matmul(x, w, s, cb, idx), ref.gather_matmul(x, w, s, cb, idx))
    assert stream.getvalue() == ("tqbench: fused TurboQuant kernel failed its self-check on cuda (gather, 3 levels, "
                                 "group 128, float16: RuntimeError: Failed to compile kernel: something); "
                                 "using the reference path\n")


def test_nan_fails_the_self_check() -> None:
    stream = io.StringIO()
    d = K.Dispatcher(backend="cuda", matmul_kernel=lambda x, w, s, cb, b: ref.matmul(x, w, s, cb) * np.nan,
                     stream=stream)
    w, s, cb = _inputs()
    x = mx.random.normal((1, 896), key=mx.random.key(6))
    assert mx.array_equal(d.matmul(x, w[0], s[0], cb), ref.matmul(x, w[0], s[0], cb))
    assert "relative error nan" in stream.getvalue()


def test_large_batches_and_odd_shapes_use_the_reference() -> None:
    mm = _Kernel(_good_matmul)
    d = K.Dispatcher(backend="cuda", matmul_kernel=mm, stream=io.StringIO())
    w, s, cb = _inputs()
    x = mx.random.normal((9, 896), key=mx.random.key(7))  # prefill: more than MAX_ROWS rows
    assert mx.array_equal(d.matmul(x, w[0], s[0], cb), ref.matmul(x, w[0], s[0], cb))
    assert mm.calls == 0
    w2, s2, cb2 = K.random_case(8, 64, 896, 50, 1, key=1)  # out % 4 != 0
    x = mx.random.normal((1, 896), key=mx.random.key(8))
    assert mx.array_equal(d.matmul(x, w2[0], s2[0], cb2), ref.matmul(x, w2[0], s2[0], cb2))
    assert mm.calls == 0
    # gather with as many expert copies as experts (prefill) takes the reference
    gm = _Kernel(_good_gather)
    d = K.Dispatcher(backend="cuda", gather_kernel=gm, stream=io.StringIO())
    idx = mx.array([[0, 1, 2, 3, 4, 5]], dtype=mx.uint32)
    xg = mx.random.normal((1, 1, 1, 896), key=mx.random.key(9))
    assert mx.array_equal(d.gather_matmul(xg, w, s, cb, idx), ref.gather_matmul(xg, w, s, cb, idx))
    assert gm.calls == 0


def test_no_backend_never_runs_a_kernel() -> None:
    mm = _Kernel(_good_matmul)
    d = K.Dispatcher(backend=None, matmul_kernel=mm)
    w, s, cb = _inputs()
    x = mx.random.normal((1, 896), key=mx.random.key(10))
    assert mx.array_equal(d.matmul(x, w[0], s[0], cb), ref.matmul(x, w[0], s[0], cb))
    assert mm.calls == 0 and d.checked == {}
