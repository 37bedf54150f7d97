"""The flat module paths of earlier versions (`minillm.roofline`, `minillm.engine_spec`, ...) keep
importing: course labs written against them still run. Each old name is an alias of the module's
new home in a concept package; `python -m minillm.<old name>` works too. Nothing is loaded until
an old path is asked for, so `import minillm` stays light."""
import importlib
import importlib.abc
import importlib.util
import sys
import types

OLD_PATHS = {  # old flat module -> its package home
    "config": "model.config", "loading": "model.loading", "hf_convert": "model.hf_convert",
    "kv_cache": "model.kv_cache", "generate": "model.generate", "chat": "model.chat",
    "sampling": "model.sampling",
    "cpu_kernels": "kernels.cpu_kernels", "cpu_tuning": "kernels.cpu_tuning",
    "cuda_graphs": "bench.cuda_graphs",
    "block_manager": "paging.block_manager", "paged_attention": "paging.paged_attention",
    "sequence": "engine.sequence", "scheduler": "engine.scheduler",
    "model_runner": "engine.model_runner", "engine_spec": "engine.spec_decoder",
    "detokenizer": "engine.detokenizer", "engine_args": "engine.args", "engine_config": "engine.config",
    "speculative": "spec.rejection", "proposers": "spec.proposers", "spec_decode": "spec.loop",
    "roofline": "analysis.roofline", "kv_math": "analysis.kv_math", "spec_theory": "analysis.spec_theory",
    "plotting": "viz.plotting", "plots_roofline": "viz.roofline", "paging_viz": "viz.paging",
    "engine_viz": "viz.serving", "spec_plots": "viz.spec", "widgets": "viz.widgets",
    "bench_decode": "bench.decode", "bench_kernels": "bench.kernels",
    "bench_overhead": "bench.overhead", "bench_roofline": "bench.roofline",
    "bench_serving": "bench.serving", "bench_spec": "bench.spec", "benchutil": "bench.common",
    "gpu_model": "bench.gpu_model", "gpu_run": "bench.gpu_run", "results": "bench.results",
    "workloads": "bench.workloads", "spec_replay": "bench.spec_replay", "engine_demo": "bench.demo",
    "roofline_measure": "bench.measure",
}
# minillm.model and minillm.engine are packages now; their old contents are re-exported there.


def new_name(fullname: str) -> str | None:
    head, _, old = fullname.partition(".")
    return f"minillm.{OLD_PATHS[old]}" if head == "minillm" and old in OLD_PATHS else None


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `minillm.<old>` and hands back the module at its new path (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

    def create_module(self, spec):
        return None                                   # a placeholder, replaced below

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(new_name(module.__name__))

    def get_code(self, fullname):                     # for `python -m minillm.<old>`
        new = new_name(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


class Package(types.ModuleType):
    """minillm itself: `minillm.generate` and `minillm.chat` stay the functions even after
    someone imports the old modules of the same names."""

    def __setattr__(self, name, value):
        if name in ("generate", "chat") and isinstance(value, types.ModuleType) and name in self.__dict__:
            return
        super().__setattr__(name, value)

    def __getattr__(self, name):                      # minillm.roofline without an import
        if name in OLD_PATHS:
            return importlib.import_module(f"minillm.{name}")
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")


def install(package_name: str) -> None:
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())
    sys.modules[package_name].__class__ = Package
