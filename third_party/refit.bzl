"""refit_cc_library: a cc_library of refit's own, usable from any workspace.

Every library under lib/ and engines/ is declared with it, so that

  * its headers are included as <refit/...> wherever refit is a dependency:
    lib/X.h is <refit/X.h>, engines/E/X.h is <refit/engines/E/X.h> (Bazel's
    include prefixes; no file moves), and a consumer's own lib/config.h can never
    shadow refit's;
  * it compiles as C++20 whatever the consumer's .bazelrc says;
  * it is linked whole (alwayslink): engines register themselves from static
    initialisers, and the shared library of `./refit install` (//:librefit.so)
    holds every object, not only those something in it happens to reference.

A consumer's own code that includes refit's headers needs C++20 too (they use
coroutines): see "Using refit from your project" in the README.
"""

# C++20 for refit's own sources; given per target so a consumer need not set it.
REFIT_COPTS = ["-std=c++20"]

def refit_include_prefix(package):
    """The include_prefix / strip_include_prefix pair for a package of refit's
    library (lib/, engines/); none for tests and examples."""
    if package == "lib" or package.startswith("lib/"):
        return {"include_prefix": "refit", "strip_include_prefix": "/lib"}
    if package == "engines" or package.startswith("engines/"):
        return {"include_prefix": "refit", "strip_include_prefix": "/"}
    return {}

def refit_include_path(package, path):
    """Where `path` (a file of `package`, relative to the repository root) is
    included from: lib/cuda/fill.h -> refit/cuda/fill.h."""
    prefix = refit_include_prefix(package)
    if not prefix:
        return path
    strip = prefix["strip_include_prefix"].lstrip("/")
    if strip and path.startswith(strip + "/"):
        path = path[len(strip) + 1:]
    return prefix["include_prefix"] + "/" + path

def refit_cc_library(name, copts = [], **kwargs):
    """A cc_library with refit's include prefix and C++20."""
    kwargs.setdefault("alwayslink", True)
    native.cc_library(
        name = name,
        copts = REFIT_COPTS + copts,
        **dict(refit_include_prefix(native.package_name()), **kwargs)
    )
