"""Checked by mypy (python/lint.sh), not run: the installed wheel's types reach a
user's checker. Each ``type: ignore`` must be needed (warn_unused_ignores), which
it is only when refit's names are typed: were py.typed or the extension's stub
missing, they would be Any and mypy would report the ignores as unused."""

import refit
from refit import _refit

names: list[str] = refit.backends()
wrong: int = _refit.backends()  # type: ignore[assignment]
refit.Engine("tcp", no_such_option=1)  # type: ignore[call-arg]
error: type[refit.Error] = refit.TimeoutError
not_an_error: type[refit.Error] = refit.Engine  # type: ignore[assignment]
version: str = refit.__version__
