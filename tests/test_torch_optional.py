"""The CPU path runs where torch is not installed (a plain `pip install infra-lab`).

Each test runs Python in a subprocess with `torch` and `triton` set to None in sys.modules,
which makes `import torch` fail and `importlib.util.find_spec("torch")` answer None, exactly as
when the package is absent.
"""
import os
import subprocess
import sys
import textwrap

HIDE_TORCH = 'import sys\nsys.modules.update(torch=None, triton=None)  # as if not installed\n'
TORCH_FACES = {"infra_lab.model.torch_model", "infra_lab.model.train", "infra_lab.model.precision",
               "infra_lab.moe.torch_moe", "infra_lab.moe.expert_parallel",
               "infra_lab.moe.ep_runs",
               # chapter 10 trains across processes with torch.distributed: all of it but the models
               # (memory, plan, ring) needs torch
               *(f"infra_lab.parallel.{name}" for name in (
                   "comm", "units", "ddp", "zero", "zero3", "runs", "tensor", "pipeline", "pipeline_runs",
                   "checkpointing")),
               # chapter 11's trainer, its losses and the loop that runs them are torch code
               *(f"infra_lab.rl.{name}" for name in ("losses", "trainer", "loop", "layouts", "warm_start")),
               "infra_lab.diagrams.tensor_parallel",  # draws what parallel.tensor's shards compute
               "infra_lab.grading.ch10_ranks"}  # and every *_triton kernel


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    env = os.environ | {"INFRA_LAB_BACKEND": "numba"}
    env.pop("INFRA_LAB_DEVICE", None)
    return subprocess.run([sys.executable, "-c", HIDE_TORCH + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600)


def test_both_shipped_models_load_and_generate_without_torch():
    done = run_without_torch("""
        from infra_lab import backend, model

        assert backend.current().name == "numba", backend.current()
        for size in ("target", "draft"):
            loaded = model.load(size)
            generation = model.generate(loaded, "def ", max_new_tokens=4, temperature=0)
            assert len(generation.new_tokens) == 4, (size, generation)
        """)
    assert done.returncode == 0, done.stderr


def test_every_module_but_the_torch_faces_imports_without_torch():
    done = run_without_torch(f"""
        import importlib, pkgutil
        import infra_lab

        failed = []
        for info in pkgutil.walk_packages(infra_lab.__path__, "infra_lab."):
            if info.name not in {sorted(TORCH_FACES)!r} and not info.name.endswith("_triton"):
                try:
                    importlib.import_module(info.name)
                except ImportError as error:
                    failed.append(f"{{info.name}}: {{error}}")
        assert not failed, "\\n".join(failed)
        """)
    assert done.returncode == 0, done.stderr
