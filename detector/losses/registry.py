"""The strategy registry: one name, one callable, one target layout.

The package's strategies register themselves when detector/losses/__init__.py imports them. A strategy from
outside the package is found by its name when first asked for (``get_strategy``):

- ``<module>:<attribute>`` (``my_ciou:ciou_loss``): ``attribute`` of the module ``module`` (a file ``my_ciou.py``
  in the folder you run from, or on PYTHONPATH), registered under that very name. It is a ``Strategy``, or a
  function ``(pred, targets) -> 0-dim loss`` with a ``layout`` attribute (``per_box_loss`` builds one) and,
  optionally, ``description`` and ``reference`` (see ``Strategy``).
- an entry point of the group ``detector.strategies`` of an installed package (``ciou = "my_pkg.ciou:ciou_loss"``
  in its pyproject.toml's ``[project.entry-points."detector.strategies"]``), registered under its entry point's
  name (``ciou``); ``KnownStrategies`` lists them with the package's own.

A strategy from outside is the user's code: importing it, and each call of it, fails as one line naming the
strategy (``OutsideStrategyError``, a UserError: ``error: ...``, exit 2, the traceback under --debug) where it
raises or exits, takes other arguments than ``(pred, targets)``, or returns anything but a 0-dim floating tensor
connected to pred's graph. Profile, train and bench all call it through that check (``checked``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from detector.data.targets import LAYOUTS, Targets
from detector.errors import UserError
from detector.losses.checks import check_targets

ENTRY_POINTS = "detector.strategies"  # the entry-point group of strategies from installed packages
OUTSIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # module:attribute


@dataclass(frozen=True)
class Strategy:
    name: str
    layout: str  # which targets it consumes: "list", "padded" or "packed" (detector.data.targets)
    fn: Callable[[Tensor, Targets], Tensor]
    description: str  # one line, shown by `python -m detector strategies`
    # Why it cannot run on a device (e.g. "the extension is not built: run make setup"), or None if it can.
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    # Why its times on a device are not those of the code it is built for (an emulator), or None.
    emulated: Callable[[torch.device], str | None] = lambda device: None
    compiled: bool = False  # whether it runs through torch.compile (the "which strategy" table's compiled row)
    # The float64 reference its loss and gradient are checked against (tests/losses/test_strategies.py): a function
    # (pred [B, M, 4] fp64, PaddedTargets) -> loss. None: the contract's GIoU, giou_loss_reference; a loss of
    # another kind (per_box_loss's) brings its own.
    reference: Callable[[Tensor, Targets], Tensor] | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"strategy {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}")

    def __call__(self, pred: Tensor, targets: Targets) -> Tensor:
        """The public entry: checks pred and targets once, then runs the strategy (which trusts them)."""
        check_targets(pred, targets)
        if targets.layout != self.layout:
            raise TypeError(
                f"strategy {self.name!r} takes {self.layout!r} targets, got {targets.layout!r} "
                f"(build them with detector.data.targets.make_targets(boxes_list, {self.layout!r}, max_boxes))"
            )
        reason = self.unavailable(pred.device)
        if reason:
            raise RuntimeError(f"strategy {self.name!r} cannot run on {pred.device}: {reason}")
        return self.fn(pred, targets)

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` of a loss built on this strategy's: where the strategy is the user's (``checked``), its
        backward raising, or giving pred a gradient of another shape or none, is one line naming it."""
        watch = getattr(self.fn, "watch", None)
        try:
            loss.backward()
        except Exception as err:
            found = watch.failure(err) if watch is not None else None
            if found is None:
                raise
            raise found from err
        if watch is not None:
            watch.check()

    def nonfinite_gradient(self) -> None:
        """Raise where a user's backward gave pred a non-finite gradient since the last call (reads a device flag:
        call it where the host waits anyway)."""
        watch = getattr(self.fn, "watch", None)
        if watch is not None and watch.nonfinite is not None:
            flag, watch.nonfinite = watch.nonfinite, None
            if bool(flag):
                raise OutsideStrategyError(
                    f"strategy {self.name!r}: its backward gave pred a non-finite gradient (NaN or infinity) where the "
                    "loss was finite: the model's weights would become NaN"
                )


STRATEGIES: dict[str, Strategy] = {}


class OutsideStrategyError(UserError, ValueError):
    """A strategy from outside the package that cannot be imported or is not a loss: one line saying why."""


def register(strategy: Strategy) -> Strategy:
    if strategy.name in STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} is registered twice")
    STRATEGIES[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """The strategy ``name``: a registered one, or one from outside (module:attribute, or an installed entry point)."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if OUTSIDE.fullmatch(str(name)):
        return register(outside(name, import_attribute(name)))
    if ":" in str(name):
        raise OutsideStrategyError(
            f"strategy {name!r}: name a module and its attribute, my_module:my_loss for my_loss in my_module.py (in "
            "the folder you run from, or on PYTHONPATH), not a file's path"
        )
    found = installed().get(name)
    if found:
        return register(outside(name, load_entry_point(found)))
    raise KeyError(
        f"unknown strategy {name!r}; valid strategies: {', '.join([*STRATEGIES, *installed()])}, or my_module:my_loss "
        "for a loss in my_module.py (README: a strategy of your own)"
    ) from None


class KnownStrategies(Mapping):
    """Every strategy a name can pick: the registered ones and the installed packages' (iterating lists them), and
    any ``module:attribute`` (asking for it imports it; one that cannot be imported is an OutsideStrategyError)."""

    def __getitem__(self, name: str) -> Strategy:
        return get_strategy(name)

    def __iter__(self) -> Iterator[str]:
        for name in list(installed()):
            get_strategy(name)
        return iter(list(STRATEGIES))

    def __len__(self) -> int:
        return len(set(STRATEGIES) | set(installed()))


# ----------------------------------------------------------------------------- strategies from outside


def outside(name: str, found) -> Strategy:
    """``found`` (a Strategy, or a loss function with a ``layout``) as the strategy ``name``, its calls checked."""
    if isinstance(found, Strategy):
        return dataclasses.replace(found, name=name, fn=checked(name, found.fn))
    if not callable(found):
        raise OutsideStrategyError(
            f"strategy {name!r} is a {type(found).__name__}, expected a loss function (pred, targets) -> loss"
        )
    layout = getattr(found, "layout", None)
    if layout not in LAYOUTS:
        fn = getattr(found, "__name__", "the function")
        raise OutsideStrategyError(
            f"strategy {name!r}: {fn}.layout is {layout!r}; set it to the targets it takes, one of "
            f"{', '.join(LAYOUTS)} (detector.data.targets), e.g. {fn}.layout = 'padded'"
        )
    doc = (getattr(found, "__doc__", None) or "").strip().splitlines()
    description = getattr(found, "description", None) or (doc[0] if doc else f"{name}, from outside the package")
    return Strategy(name, layout, checked(name, found), description, reference=getattr(found, "reference", None))


def checked(name: str, fn: Callable) -> Callable[[Tensor, Targets], Tensor]:
    """``fn``, a loss of the user's, whose every failure is one OutsideStrategyError naming the strategy ``name``:
    a signature that does not take (pred, targets) (said here, before any call), an exception or sys.exit inside
    it, a result that is not a 0-dim floating tensor, or one without a gradient where pred needs one. No check
    reads a device value: the step runs ahead of the GPU as before."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as err:
        shown = f"{getattr(fn, '__name__', 'it')}{inspect.signature(fn)}"
        raise OutsideStrategyError(
            f"strategy {name!r}: {shown} cannot take a loss's arguments (pred, targets): {err}"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): its first call says what is wrong
    home = getattr(getattr(fn, "__code__", None), "co_filename", None)  # where its own lines are

    @functools.wraps(fn)
    def loss(pred: Tensor, targets: Targets) -> Tensor:
        watch = None
        if torch.is_grad_enabled() and pred.requires_grad and not capturing(pred):
            watch = loss.watch = BackwardWatch(name, home, previous=loss.watch)
            pred = _Leave.apply(pred, watch)
        try:
            value = fn(pred, targets)
        except Exception as err:
            raise OutsideStrategyError(f"strategy {name!r} raised {failure(err, home)}") from err
        except SystemExit as err:
            raise OutsideStrategyError(f"strategy {name!r} called sys.exit({err.code!r}){where(err, home)}") from err
        wrong = not_a_loss(value, pred)
        if wrong:
            raise OutsideStrategyError(f"strategy {name!r} returned {wrong}")
        if watch is None:
            return value
        watch.loss_finite = torch.isfinite(value.detach())  # a NaN loss's NaN gradient is the loss's, said elsewhere
        return _Enter.apply(value, watch)

    loss.watch = None
    return loss


def capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class BackwardWatch:
    """A user's loss (``checked``) in the backward of one call: where its gradient entered (the loss) and left (pred),
    and whether pred's gradient was finite wherever the loss was (a device flag, carried from call to call and read
    only where the host waits anyway: ``Strategy.nonfinite_gradient``)."""

    def __init__(self, name: str, home: str | None, previous: BackwardWatch | None):
        self.name, self.home = name, home
        self.entered = self.left = self.missing = False
        self.loss_finite: Tensor | None = None
        self.nonfinite: Tensor | None = previous.nonfinite if previous is not None else None

    def failure(self, err: Exception) -> OutsideStrategyError | None:
        """``err`` as the user's, where it was raised between the loss and pred: in their backward."""
        if self.entered and not self.left:
            # only a line of the user's file: autograd's own check of what their backward returned (a gradient of
            # the wrong shape) rises in torch's graph.py, which would send them to the wrong file
            return OutsideStrategyError(
                f"strategy {self.name!r}: its backward raised {failure(err, self.home, home_only=True)}"
            )
        return None

    def check(self) -> None:
        """After a backward that ran through the loss: pred must have got a gradient."""
        if self.entered and (self.missing or not self.left):
            raise OutsideStrategyError(
                f"strategy {self.name!r}: its backward gave pred no gradient (None): the model would learn nothing "
                "from it; return the gradient of the loss with respect to pred"
            )


class _Enter(torch.autograd.Function):
    """The identity on a user's loss, marking where the backward enters their code."""

    @staticmethod
    def forward(ctx, value: Tensor, watch: BackwardWatch) -> Tensor:
        ctx.watch = watch
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.watch.entered = True
        return grad, None


class _Leave(torch.autograd.Function):
    """The identity on pred as a user's loss receives it, marking where the backward leaves their code."""

    @staticmethod
    def forward(ctx, pred: Tensor, watch: BackwardWatch) -> Tensor:
        ctx.set_materialize_grads(False)  # a gradient the user's backward did not give arrives as None
        ctx.watch = watch
        return pred.view_as(pred)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        watch = ctx.watch
        watch.left = True
        if grad is None:
            watch.missing = True
            return None, None
        bad = ~torch.isfinite(grad).all() & watch.loss_finite  # on the device: no host wait
        watch.nonfinite = bad if watch.nonfinite is None else watch.nonfinite | bad
        return grad, None


def not_a_loss(value, pred: Tensor) -> str | None:
    """What ``value`` is, where it is not a loss of ``pred`` (a 0-dim floating tensor, with a gradient where pred
    needs one); None where it is."""
    if not isinstance(value, Tensor):
        shown = f" ({value!r:.40})" if isinstance(value, int | float | str) else ""
        return f"{'None' if value is None else 'a ' + type(value).__name__}{shown}, expected a 0-dim tensor: the loss"
    if value.dim() != 0:
        return f"a tensor of shape {list(value.shape)}, expected a 0-dim loss (the mean over the batch's boxes)"
    if not value.is_floating_point():
        return f"a tensor of dtype {value.dtype}, expected a floating loss"
    if torch.is_grad_enabled() and pred.requires_grad and not value.requires_grad:
        return (
            "a loss without a gradient (requires_grad=False) though pred requires one: does it detach pred, call "
            ".item() or .numpy(), or run under torch.no_grad()?"
        )
    return None


def import_attribute(spec: str):
    """The object ``module:attribute`` names; the folder the command runs from is searched after sys.path."""
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `python -m detector` finds my_ciou.py there; pytest and scripts too
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name or module_name.startswith(f"{err.name}."):
            raise OutsideStrategyError(
                f"strategy {spec!r}: no module {err.name} (a {err.name.replace('.', '/')}.py in {os.getcwd()} or "
                "on PYTHONPATH)"
            ) from None
        raise OutsideStrategyError(f"strategy {spec!r}: importing {module_name} failed: {failure(err)}") from None
    except Exception as err:  # the user's code: its error, in one line, where --debug shows the traceback
        raise OutsideStrategyError(f"strategy {spec!r}: importing {module_name} failed: {failure(err)}") from err
    except SystemExit as err:  # else the command would end here, with the module's status and no word
        raise OutsideStrategyError(
            f"strategy {spec!r}: importing {module_name} called sys.exit({err.code!r}){where(err)}: a module that "
            "holds a loss must import without exiting (under if __name__ == '__main__':, a script's code does not run)"
        ) from err
    if not hasattr(module, attribute):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise OutsideStrategyError(
            f"strategy {spec!r}: {getattr(module, '__file__', module_name)} has no {attribute!r} "
            f"(it defines {', '.join(defined) or 'no function'})"
        )
    return getattr(module, attribute)


def failure(err: BaseException, home: str | None = None, home_only: bool = False) -> str:
    """``NameError: name 'x' is not defined (my_ciou.py, line 5)``: an exception and where it rose (its last line in
    the file ``home``, where it passed through it; only there with ``home_only``)."""
    return f"{type(err).__name__}: {' '.join(str(err).split()) or '-'}{where(err, home, home_only)}"


def where(err: BaseException, home: str | None = None, home_only: bool = False) -> str:
    """`` (my_ciou.py, line 5)``: the last line of ``err``'s traceback, or of it in the file ``home``; or nothing
    (also where ``home_only`` and it never passed through ``home``)."""
    frames, frame = [], err.__traceback__
    while frame:
        frames.append(frame)
        frame = frame.tb_next
    own = [f for f in frames if f.tb_frame.f_code.co_filename == home]
    if home_only and not own and not isinstance(err, SyntaxError):
        return ""
    last = (own or frames or [None])[-1]
    if isinstance(err, SyntaxError):  # raised by the compiler, whose frames are not the file's
        filename, lineno = err.filename, err.lineno
    else:
        filename, lineno = (last.tb_frame.f_code.co_filename, last.tb_lineno) if last else (None, None)
    return f" ({os.path.basename(filename)}, line {lineno})" if filename and lineno else ""


def installed() -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points of the group ``detector.strategies`` of the installed packages, by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def load_entry_point(entry: importlib.metadata.EntryPoint):
    try:
        return entry.load()
    except (Exception, SystemExit) as err:  # the package's code
        raise OutsideStrategyError(
            f"strategy {entry.name!r} ({entry.value}, entry point of {ENTRY_POINTS}) failed to load: {failure(err)}"
        ) from err
