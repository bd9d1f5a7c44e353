"""The C++ extension's sources build for aarch64 (Arm: AWS Graviton, Apple silicon under Linux).

CI cannot run Arm, so every ``csrc/*.cpp`` is cross-compiled with Debian's
``aarch64-linux-gnu-g++`` (package ``g++-aarch64-linux-gnu``) using the flags of the real build
(setup.py's ``-O3 -g0 -fopenmp -Wno-psabi``, torch's ``-std=c++20``) plus ``-Wall``, against the
installed torch's headers and Python's. The object file is compiled (``-c``), not only parsed:
``-fsyntax-only`` passes an unguarded ``asm("pause")`` (an assembler error) and an unguarded
``target_clones("arch=x86-64-v4", ...)`` (rejected only when code is generated).

torch's headers are arch-aware (``Half.h`` takes ``<arm_neon.h>`` on aarch64, ``<immintrin.h>``
on x86; ``ApproximateClock.h`` has an aarch64 branch) and the generated ``cmake_macros.h`` holds
no arch switch, so the x86 wheel's headers serve for an aarch64 compile; they are passed as
``-isystem`` (as torch's own ninja build does) so that only warnings in our files count.
Linking is not checked (no aarch64 libtorch here).

Skipped when the cross compiler is not installed. ``test_x86_code_is_guarded`` needs no
compiler: every x86-only construct (intrinsics headers and calls, ``__m512`` types, x86
builtins and target attributes) must sit inside an ``#if`` on ``__x86_64__``.
"""

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
CROSS_CXX = shutil.which("aarch64-linux-gnu-g++")
EM_AARCH64 = 183  # ELF e_machine of an aarch64 object

# setup.py's cxx flags, the -std torch's BuildExtension adds, and -Wall.
FLAGS = ["-std=c++20", "-O3", "-g0", "-fopenmp", "-Wno-psabi", "-Wall"]


def cross_compile_cmd(source: Path, obj: Path) -> list[str]:
    """The aarch64 compile command for ``source`` writing ``obj``."""
    system = [*torch.utils.cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [CROSS_CXX, *FLAGS, "-c", "-I", str(CSRC),
            *[a for inc in system for a in ("-isystem", inc)], str(source), "-o", str(obj)]


def test_sources_exist():
    names = [p.name for p in SOURCES]
    assert "bindings.cpp" in names and "pool.cpp" in names, names


@pytest.mark.skipif(CROSS_CXX is None, reason="aarch64-linux-gnu-g++ is not installed "
                    "(Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_aarch64_compiles(source, tmp_path):
    obj = tmp_path / f"{source.stem}.o"
    cmd = cross_compile_cmd(source, obj)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    assert "warning:" not in proc.stderr, f"{' '.join(cmd)}\n{proc.stderr}"
    header = obj.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64


# ---- x86-only code sits in x86-guarded preprocessor blocks ---------------------------------

X86_ONLY = re.compile(
    r"#\s*include\s*<(?:immintrin|x86intrin|xmmintrin|emmintrin|smmintrin|cpuid)\.h>"
    r"|\b_mm\d*_\w+|\b__m(?:128|256|512)\w*|\b__mmask\d+|\b_MM_\w+|\b__builtin_ia32_\w+"
    r"|\b__builtin_cpu_(?:supports|is|init)\b|\b__cpuid\w*|\b_xgetbv\b|\b_tile_\w+"
    r"|target(?:_clones)?\s*\(\s*\"[^\"]*(?:avx|sse|amx|x86-64|fma|f16c)",
)
# A condition is x86-only when it names an x86 macro, does not negate one, and names no other
# architecture.
_X86 = r"(?:__x86_64__|__i386__|__amd64__|_M_X64)\b"
X86_MACRO = re.compile(r"defined\s*\(?\s*" + _X86)
NOT_X86 = re.compile(r"!\s*defined\s*\(?\s*" + _X86
                     + r"|__aarch64__|__arm|__ARM|__powerpc|__riscv|__s390|_M_ARM")


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each line of ``text`` with comments removed and
    backslash-continued lines joined."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out, start, parts = [], 0, []
    for no, line in enumerate(text.split("\n"), 1):
        if not parts:
            start = no
        parts.append(line[:-1] if line.endswith("\\") else line)
        if not line.endswith("\\"):
            out.append((start, " ".join(parts)))
            parts = []
    return out


def unguarded_x86(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each x86-only construct in C/C++ ``text`` that is not inside the
    true branch of an ``#if``/``#ifdef``/``#elif`` whose condition is x86-only."""
    stack: list[bool] = []  # per open #if: is the current branch x86-only?
    found = []
    for no, line in _logical_lines(text):
        directive = re.match(r"\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)", line)
        if directive:
            kind, cond = directive.groups()
            if kind == "ifdef":
                cond = f"defined({cond.strip()})"
            x86 = bool(X86_MACRO.search(cond)) and not NOT_X86.search(cond)
            if kind in ("if", "ifdef", "ifndef"):
                stack.append(x86 and kind != "ifndef")
            elif kind == "elif" and stack:
                stack[-1] = x86
            elif kind == "else" and stack:
                stack[-1] = False
            elif kind == "endif" and stack:
                stack.pop()
        elif not any(stack) and X86_ONLY.search(line):
            found.append((no, line.strip()))
    return found


@pytest.mark.parametrize("code, bad", [
    ("#include <immintrin.h>\nvoid f() { _mm_pause(); }\n", [1, 2]),
    ("#if defined(__x86_64__) && defined(__GNUC__)\n#include <immintrin.h>\n#endif\n", []),
    ("#ifdef __x86_64__\n__m512 v;\n#else\n__m512 w;\n#endif\n", [4]),
    ("#if defined(__x86_64__)\nint a;\n#elif defined(__aarch64__)\n__builtin_ia32_pause();\n"
     "#endif\n", [4]),
    ("#if defined(__x86_64__) || defined(__aarch64__)\n_mm_pause();\n#endif\n", [2]),
    ("#if defined(__x86_64__) && !defined(__CUDACC__)\n_mm_pause();\n#endif\n", []),
    ("#if (defined(__x86_64__) || \\\n     defined(__i386__)) && defined(__GNUC__)\n"
     "__builtin_ia32_pause();\n#endif\n", []),
    ("#if !defined(__x86_64__)\n_mm_pause();\n#endif\n", [2]),
    ("#if defined(__x86_64__)\n#if FOO\n_mm_pause();\n#endif\n#endif\n_mm_pause();\n", [6]),
    ("// _mm_pause() on x86\n/* __m512 */ int x;\n", []),
    ('__attribute__((target_clones("arch=x86-64-v4", "default"))) void f();\n', [1]),
    ('__attribute__((target("avx512f,avx512bw"))) void f();\n', [1]),
    ("#define SE_T \\\n  __attribute__((target(\"avx2\")))\n", [1]),
])
def test_unguarded_x86_detects(code, bad):
    assert [no for no, _ in unguarded_x86(code)] == bad


@pytest.mark.parametrize("path", sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]),
                         ids=lambda p: p.name)
def test_x86_code_is_guarded(path):
    assert unguarded_x86(path.read_text()) == [], (
        f"{path.name}: x86-only code outside `#if defined(__x86_64__) && defined(__GNUC__)`")
