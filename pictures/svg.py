"""pictures/svg.py: pictures as SVG text, written with the standard library alone.

A browser opens an SVG file; it is XML, so the text below is the whole picture: lines, areas
and bars placed in pixels, with axes, ticks, a legend and a title. pictures/draw.py draws the run's
loss, its memory over one step and its executed pipeline schedule with it. Every number is
printed rounded to a tenth of a pixel, so the same data always gives the same bytes (the tests
compare). Each drawn series carries class="series" and data-label="its name", so a test (or a
reader of the file) finds it by name. Left out: anything interactive, log scales, fonts beyond
the browser's sans-serif.
Test: python -m pytest tests/test_pictures.py
"""
import math
from xml.sax.saxutils import escape, quoteattr

# Colour-blind-safe (Okabe and Ito), in the order series take them.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values covering [lo, hi], about `count` of them: steps of 1, 2 or 5 x 10^k."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 10) for k in range(first, last + 1)]


def number(v: float) -> str:
    """A tick label: 0.5, 20, 1.5k, 3M (no trailing zeros)."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:g}{suffix}"
    return f"{v:g}"


def _px(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Canvas:
    """An SVG document: elements appended as text, drawn in that order (later on top)."""

    def __init__(self, width: int, height: int):
        self.width, self.height, self.parts = width, height, []

    def _add(self, tag: str, attributes: dict, text: str | None = None):
        words = " ".join(f"{k.replace('_', '-')}={quoteattr(v if isinstance(v, str) else _px(v))}"
                         for k, v in attributes.items() if v is not None)
        self.parts.append(f"<{tag} {words}/>" if text is None else
                          f"<{tag} {words}>{escape(text)}</{tag}>")

    def line(self, x1, y1, x2, y2, color="#000", width=1.0, dash=None):
        self._add("line", dict(x1=x1, y1=y1, x2=x2, y2=y2, stroke=color, stroke_width=width,
                               stroke_dasharray=dash))

    def rect(self, x, y, w, h, fill, label=None, stroke=None):
        self._add("rect", {"x": x, "y": y, "width": w, "height": h, "fill": fill, "stroke": stroke,
                           "class": "series" if label else None, "data-label": label})

    def text(self, x, y, s, size=12, anchor="start", color="#000", rotate=False, bold=False):
        self._add("text", {"x": x, "y": y, "font-size": size, "text-anchor": anchor, "fill": color,
                           "font-weight": "bold" if bold else None,
                           "transform": f"rotate(-90 {_px(x)} {_px(y)})" if rotate else None}, s)

    def polyline(self, points, color, label=None, width=1.5, dash=None):
        self._add("polyline", {"points": " ".join(f"{_px(x)},{_px(y)}" for x, y in points),
                               "fill": "none", "stroke": color, "stroke-width": width,
                               "stroke-dasharray": dash, "class": "series" if label else None,
                               "data-label": label})

    def polygon(self, points, fill, label=None):
        self._add("polygon", {"points": " ".join(f"{_px(x)},{_px(y)}" for x, y in points),
                              "fill": fill, "fill-opacity": "0.75", "stroke": "none",
                              "class": "series" if label else None, "data-label": label})

    def legend(self, x: float, y: float, entries: list[tuple]):
        """entries: (label, colour, dash or None, "line" or "box"), one row each."""
        for i, (label, color, dash, kind) in enumerate(entries):
            row = y + 16 * i
            if kind == "box":
                self._add("rect", dict(x=x, y=row - 9, width=18, height=10, fill=color))
            else:
                self.line(x, row - 4, x + 18, row - 4, color, 2, dash)
            self.text(x + 24, row, label, size=11)

    def svg(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" font-family="sans-serif">')
        background = f'<rect x="0" y="0" width="{self.width}" height="{self.height}" fill="#fff"/>'
        return "\n".join([head, background, *self.parts, "</svg>"]) + "\n"


class Axes:
    """A plot area of the canvas: data coordinates to pixels, and the frame around it.

    box: (left, top, width, height) in pixels; xlim, ylim: the data range shown (ylim grows to
    round ticks). The y axis points up, as on paper: SVG's points down."""

    def __init__(self, canvas: Canvas, box: tuple, xlim: tuple, ylim: tuple, yticks: list | None = None):
        self.canvas, (self.left, self.top, self.w, self.h) = canvas, box
        self.yticks = yticks or nice_ticks(*ylim)
        self.xlim, self.ylim = xlim, (min(self.yticks[0], ylim[0]), max(self.yticks[-1], ylim[1]))
        if self.xlim[1] <= self.xlim[0]:
            self.xlim = (self.xlim[0], self.xlim[0] + 1)

    def x(self, v: float) -> float:
        return self.left + (v - self.xlim[0]) / (self.xlim[1] - self.xlim[0]) * self.w

    def y(self, v: float) -> float:
        return self.top + self.h - (v - self.ylim[0]) / (self.ylim[1] - self.ylim[0]) * self.h

    def frame(self, title="", xlabel="", ylabel="", xticks=None, ytick_label=number, show_y=True):
        """Axes lines, grid, ticks and their labels, the title above and the labels beside."""
        c, bottom = self.canvas, self.top + self.h
        for v in self.yticks:
            c.line(self.left, self.y(v), self.left + self.w, self.y(v), "#e5e5e5")
            if show_y:
                c.text(self.left - 6, self.y(v) + 4, ytick_label(v), size=10, anchor="end")
        for v in nice_ticks(*self.xlim) if xticks is None else xticks:
            if self.xlim[0] <= v <= self.xlim[1]:
                c.line(self.x(v), bottom, self.x(v), bottom + 4)
                c.text(self.x(v), bottom + 16, number(v), size=10, anchor="middle")
        c.line(self.left, bottom, self.left + self.w, bottom)
        c.line(self.left, self.top, self.left, bottom)
        c.text(self.left + self.w / 2, self.top - 8, title, size=13, anchor="middle", bold=True)
        c.text(self.left + self.w / 2, bottom + 32, xlabel, size=11, anchor="middle")
        if ylabel:
            c.text(self.left - 44, self.top + self.h / 2, ylabel, size=11, anchor="middle", rotate=True)

    def plot(self, xs, ys, color, label=None, dash=None, width=1.5):
        self.canvas.polyline([(self.x(a), self.y(b)) for a, b in zip(xs, ys)], color, label, width, dash)

    def stacked(self, xs, layers: dict, colors: dict):
        """Areas stacked in dict order, the first at the bottom: layers {name: [y per x]}."""
        below = [0.0] * len(xs)
        for name, ys in layers.items():
            top = [b + v for b, v in zip(below, ys)]
            outline = [(self.x(a), self.y(t)) for a, t in zip(xs, top)]
            outline += [(self.x(a), self.y(b)) for a, b in reversed(list(zip(xs, below)))]
            self.canvas.polygon(outline, colors[name], label=name)
            below = top

    def bar(self, row: int, rows: int, start: float, end: float, color: str, text: str):
        """A horizontal bar from start to end on row `row` of `rows` (row 0 at the top)."""
        height = self.h / rows
        x0, x1, y = self.x(start), self.x(end), self.top + row * height
        self.canvas.rect(x0, y + 0.15 * height, max(x1 - x0, 0.5), 0.7 * height, color, label=text,
                         stroke="#fff")
        if x1 - x0 > 7 * len(text):                       # the label only where it fits
            self.canvas.text((x0 + x1) / 2, y + height / 2 + 4, text, size=10, anchor="middle",
                             color="#fff")


def line_chart(series: list[dict], title: str, xlabel: str, ylabel: str,
               width: int = 680, height: int = 400) -> str:
    """series: {"label", "x": [...], "y": [...], optional "dash"}, each a line in PALETTE's order,
    named in the legend at the top right."""
    xs = [v for s in series for v in s["x"]]
    ys = [v for s in series for v in s["y"]]
    c = Canvas(width, height)
    ax = Axes(c, (70, 40, width - 100, height - 90), (min(xs), max(xs)), (min(ys), max(ys)))
    ax.frame(title, xlabel, ylabel)
    for s, color in zip(series, PALETTE):
        ax.plot(s["x"], s["y"], color, s["label"], s.get("dash"))
    c.legend(ax.left + ax.w - 170, ax.top + 16,
             [(s["label"], color, s.get("dash"), "line") for s, color in zip(series, PALETTE)])
    return c.svg()
