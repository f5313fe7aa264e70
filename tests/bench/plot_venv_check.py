"""The plotting venv works: matplotlib renders a PNG without a display."""
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots()
ax.plot([1, 2], [1, 2])
buf = io.BytesIO()
fig.savefig(buf, format="png")
assert buf.getvalue().startswith(b"\x89PNG"), "matplotlib wrote no PNG"
