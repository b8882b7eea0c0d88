"""The evaluation's picture (detector/train/evaluate/pictures.py) laid out to be read at its size in TensorBoard: no
image's title over another image, everything inside the picture, and the picture as wide as TensorBoard's image cards,
which show it at its own size (the picture in the Images tab: test_export.py)."""

import pytest
import torch

from detector.train.evaluate.pictures import SHOWN, pixels, prediction_figure

CARD = 350  # px: TensorBoard's image cards (Images, Time Series) are as wide: a picture that wide shows at its size


def picture(n: int, titles=None, truth: bool = True, size: int = 64):
    """The figure of ``n`` images of noise with boxes of their own, some of them reaching past the image's edge."""
    torch.manual_seed(0)
    images = (torch.rand(n, 1, size, size) * 255).to(torch.uint8)
    corner = torch.rand(n, 16, 2) * size
    boxes = torch.cat([corner, corner + size / 4], -1)
    pred = boxes + 8 * torch.randn_like(boxes)
    counts = torch.randint(1, 5, (n,))
    return prediction_figure(images, pred, counts, boxes if truth else None, titles, "step 200: boxes")


def areas(fig):
    """Each image's drawn area with its title (px boxes of the canvas), the picture's title, and the legend."""
    renderer = fig.canvas.get_renderer()
    return [ax.get_tightbbox(renderer) for ax in fig.axes], [t.get_window_extent(renderer) for t in fig.texts]


@pytest.mark.parametrize(
    "n, titles, truth",
    [
        (SHOWN, [f"held-out {i}" for i in range(SHOWN)], True),
        (3, None, True),  # a row of two and one below
        (3, ["a file name far longer than the image is wide.png", "b.png", "c.png"], False),  # `detector predict`
    ],
    ids=["evaluation", "two-rows", "long-names"],
)
def test_no_title_reaches_another_image_and_the_picture_fits_the_images_tab(n, titles, truth):
    fig = picture(n, titles, truth)
    height, width, _ = pixels(fig).shape
    assert width <= CARD and (n != SHOWN or height <= 480), (width, height)
    cells, texts = areas(fig)
    assert len(cells) == n
    whole = fig.bbox
    for i, a in enumerate(cells):
        assert whole.x0 <= a.x0 and a.x1 <= whole.x1 and whole.y0 <= a.y0 and a.y1 <= whole.y1, (i, a, whole)
        for j, b in enumerate(cells[i + 1 :], i + 1):
            assert not a.overlaps(b), f"image {i} and its title overlap image {j}: {a} {b}"
        for text in texts:  # the picture's title and the legend's
            assert not a.overlaps(text), (i, a, text)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:  # each title within its image's width: not cut off at the picture's edge nor its neighbour's
        title, image = ax.title.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert image.x0 - 8 <= title.x0 and title.x1 <= image.x1 + 8, (ax.title.get_text(), title, image)
