"""The offline compiles of a test run, each source compiled once and shared by every test that
reads its resources or (AMD) its assembly: the catalogue's freshness (its report), its
no-scratch check and the assembly scans read one compile of each catalogue source. Long compiles
say what they do on the terminal (``progress``)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from epgen.codegen.arch import traits
from epgen.codegen.offline import CompileError, compile_assembly, compile_many, compile_offline
from epgen.codegen.render import render
from epgen.codegen.spec import sha256_key


class Compiles:
    """``compile_offline`` of ``(text, arch, entry)`` jobs, each compiled once per test run; on AMD
    through ``compile_assembly``, whose assembly the scans read from the same compile. A compile
    error is kept and raised again for the same job. ``report`` is called with a line before and
    after a batch that compiles anything."""

    def __init__(self, report):
        self._done: dict[tuple[str, str, str], tuple] = {}
        self._lock = threading.Lock()
        self._report = report

    def compile_offline(self, text: str, arch: str, entry: str):
        """As ``epgen.codegen.offline.compile_offline`` (a ``compile_fn`` for ``compile_many``)."""
        resources, _ = self._compile(text, arch, entry)
        if isinstance(resources, CompileError):
            raise resources
        return resources

    def _compile(self, text: str, arch: str, entry: str) -> tuple:
        key = (sha256_key(text), arch, entry)
        with self._lock:
            done = self._done.get(key)
        if done is None:
            try:
                done = (compile_assembly(text, arch, entry) if traits(arch).vendor == "amd"
                        else (compile_offline(text, arch, entry), None))
            except CompileError as e:
                done = (e, None)
            with self._lock:
                self._done[key] = done
        return done

    def resources(self, specs) -> list:
        """The ``compile_offline`` result of each spec's source (``Resources`` or the
        ``CompileError``), in order."""
        return self._batch(specs)

    def assembly(self, specs) -> list[str]:
        """The assembly of each AMD spec's source, in order.

        Raises:
            CompileError: a source did not compile.
        """
        self._batch(specs)
        out = []
        for s in specs:
            src = render(s)
            resources, asm = self._compile(src.text, s.arch, src.entry)
            if isinstance(resources, CompileError):
                raise resources
            out.append(asm)
        return out

    def _batch(self, specs) -> list:
        sources = [render(s) for s in specs]
        jobs = [(src.text, s.arch, src.entry) for s, src in zip(specs, sources)]
        with self._lock:
            new = len({(sha256_key(text), arch, entry) for text, arch, entry in jobs} - set(self._done))
        start = time.perf_counter()
        if new:
            self._report(f"compiling {new} sources offline ({len(jobs) - new} compiled earlier in this run)")
        results = compile_many(jobs, compile_fn=self.compile_offline)
        if new:
            self._report(f"compiled {new} sources in {time.perf_counter() - start:.0f} s")
        return results


@pytest.fixture(scope="session")
def progress(pytestconfig):
    """A callable that writes a line on the terminal while a test runs, past pytest's output
    capture: what a test that compiles for a minute is doing."""
    terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if terminal is not None:
            with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
                test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]  # path::name (phase)
                terminal.write_line(f"{test}: {line}")

    return write


@pytest.fixture(scope="session")
def compiles(progress) -> Compiles:
    """The run's ``Compiles``, telling each batch on the terminal."""
    return Compiles(report=progress)
