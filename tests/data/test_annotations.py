"""Boxes from annotation files (detector/data/annotations.py): each format well-formed, malformed, with empty images and
with images over the slots; their scaling to the images and the slots' rule. The files are the tests' own."""

import json

import numpy as np
import pytest
from annotation_helpers import coco_json, widerface_counts, widerface_text, write_coco, write_widerface

from detector.data import annotations
from detector.data.annotations import (
    WIDER_SIDE,
    AnnotationError,
    Annotations,
    Format,
    describe,
    fit_boxes,
    parse_source,
    read_annotations,
    slots_for,
)

# Two images of WIDER FACE's official layout: an empty one (count 0 and its line of zeros), then two faces.
WIDER = """0--Parade/0_Parade_marchingband_1_849.jpg
0
0 0 0 0 0 0 0 0 0 0
1--Handshaking/1_Handshaking_1_2.jpg
2
449 330 122 149 0 0 0 0 0 0
10 20 0 0 2 0 0 1 0 0
"""


def wider(tmp_path, text: str) -> str:
    (tmp_path / "gt.txt").write_text(text)
    return f"widerface:{tmp_path / 'gt.txt'}"


def refused(source: str, match: str) -> str:
    with pytest.raises(AnnotationError, match=match) as err:
        read_annotations(source)
    assert "\n" not in str(err.value)  # one line
    return str(err.value)


# ----------------------------------------------------------------------------- WIDER FACE


def test_widerface_file_gives_each_image_its_faces_the_empty_one_included(tmp_path):
    found = read_annotations(wider(tmp_path, WIDER))
    assert found.images == 2 and found.counts.tolist() == [0, 2]
    assert found.names == ["0--Parade/0_Parade_marchingband_1_849.jpg", "1--Handshaking/1_Handshaking_1_2.jpg"]
    assert found.boxes.tolist() == [[449, 330, 122, 149], [10, 20, 0, 0]]  # x y w h; a zero-size face counts
    assert found.sizes.tolist() == [[WIDER_SIDE, WIDER_SIDE]] * 2


def test_widerface_without_the_zeros_line_and_with_blank_lines_reads_the_same(tmp_path):
    text = WIDER.replace("0 0 0 0 0 0 0 0 0 0\n", "\n")
    assert read_annotations(wider(tmp_path, text)).counts.tolist() == [0, 2]


def test_widerface_image_larger_than_1024_is_scaled_by_its_extent(tmp_path):
    found = read_annotations(wider(tmp_path, "a.jpg\n1\n1500 10 500 100 0 0 0 0 0 0\n"))
    assert found.sizes.tolist() == [[2000, 2000]]  # x + w = 2000 px: the image is at least that wide
    fitted = fit_boxes(found, 256, 8)
    assert fitted.of(0).tolist() == [[192, 1, 255, 14]]  # x: 1500/2000*256 = 192; y2: ceil(110/2000*256) - 1 = 14


@pytest.mark.parametrize(
    "text,match",
    [
        ("a.jpg\n2\n1 2 3 4 0 0 0 0 0 0\n", r"line 2: a.jpg has 2 faces but only 1 lines follow"),
        ("a.jpg\ntwo\n", r"line 2: expected the number of faces of a.jpg, got 'two'"),
        ("a.jpg\n1\n1 2 three 4\n", r"line 3: expected a face, x y w h .*got '1 2 three 4'"),
        ("a.jpg\n1\n1 2 3\n", r"line 3: expected a face"),
        ("a.jpg\n1\n1 2 -3 4 0 0 0 0 0 0\n", r"line 3: a face's x, y, width and height must be >= 0"),
        ("a.jpg\n1\n1 2 3 4\n5 6 7 8\nb.jpg\n0\n", r"line 4: expected an image's path .*after the 1 faces of a.jpg"),
        ("a.jpg\n", r"line 1: the image a.jpg has no count line"),
        ("\n\n", r"holds no image"),
        ("a.jpg\n1\n1 2 nan 4\n", r"line 3: expected a face"),
    ],
)
def test_malformed_widerface_is_refused_naming_the_line(tmp_path, text, match):
    message = refused(wider(tmp_path, text), match)
    assert message.startswith(f"data.boxes=widerface:{tmp_path / 'gt.txt'}: ")


# ----------------------------------------------------------------------------- COCO


def test_coco_file_groups_boxes_by_image_in_its_order_and_leaves_crowds_out(tmp_path):
    counts = [3, 0, 5, 1]
    data = coco_json(counts, crowds=True)
    found = read_annotations(f"coco:{write_coco(tmp_path / 'instances.json', data)}")
    assert found.counts.tolist() == counts  # empty image 1 kept; each image's crowd region is not a box
    assert found.names[2] == "000000000002.jpg" and found.sizes.tolist() == [[640, 480]] * 4
    expected = [
        a["bbox"]
        for image in data["images"]
        for a in data["annotations"]
        if a["image_id"] == image["id"] and not a["iscrowd"]
    ]
    assert found.boxes.tolist() == expected  # image by image, in the file's order within an image


def test_coco_boxes_scale_to_the_square_image_on_each_axis(tmp_path):
    data = {
        "images": [{"id": 7, "width": 640, "height": 320}],
        "annotations": [{"image_id": 7, "bbox": [320, 80, 160, 40], "iscrowd": 0}],
    }
    fitted = fit_boxes(read_annotations(f"coco:{write_coco(tmp_path / 'c.json', data)}"), 64, 4)
    assert fitted.of(0).tolist() == [[32, 16, 47, 23]] and fitted.boxes.dtype == np.uint8
    assert fit_boxes(read_annotations(f"coco:{tmp_path / 'c.json'}"), 512, 4).boxes.dtype == np.int16


def coco_with(change) -> dict:
    data = coco_json([2, 1])
    change(data)
    return data


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda d: d.pop("annotations"), r"annotations is None, expected a list"),
        (lambda d: d.update(images={}), r"images is \{\}, expected a list"),
        (lambda d: d["annotations"][1].update(bbox=[1, 2, 3]), r"annotations\[1\]\.bbox is \[1, 2, 3\], expected"),
        (lambda d: d["annotations"][0].update(bbox=[1, 2, -3, 4]), r"annotations\[0\]\.bbox .* must be >= 0"),
        (lambda d: d["annotations"][2].update(image_id=999), r"annotations\[2\]\.image_id is 999: no image"),
        (lambda d: d["annotations"][0].update(iscrowd=2), r"annotations\[0\]\.iscrowd is 2, expected 0 or 1"),
        (lambda d: d["images"][1].update(id=100), r"images\[1\]\.id is 100: a repeated id"),
        (
            lambda d: d["images"][0].update(width=0),
            r"images\[0\]\.width is 0, expected a number of pixels in \[1, 65,5",
        ),
        (lambda d: d["images"][0].pop("height"), r"images\[0\]\.height is None"),
        (lambda d: d.update(images=[]), r"images is empty"),
    ],
)
def test_malformed_coco_is_refused_naming_the_field(tmp_path, change, match):
    refused(f"coco:{write_coco(tmp_path / 'c.json', coco_with(change))}", match)


def test_a_file_that_is_not_json_or_not_there_is_one_line(tmp_path):
    (tmp_path / "c.json").write_text('{"images": [')
    refused(f"coco:{tmp_path / 'c.json'}", r"is not JSON")
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    refused(f"coco:{tmp_path / 'list.json'}", r"expected a JSON object .*got a list")
    refused(f"coco:{tmp_path / 'missing.json'}", r"cannot read .*missing.json")
    refused(f"widerface:{tmp_path}", r"is not a file")


@pytest.mark.parametrize("source", ["voc:a.xml", "coco", "coco:", "a.json"])
def test_an_unknown_format_names_the_allowed_ones(source):
    with pytest.raises(AnnotationError, match="allowed synthetic, coco:<instances.json>, widerface:"):
        parse_source(source)


def test_a_changed_file_is_read_again(tmp_path):
    source = wider(tmp_path, WIDER)
    assert read_annotations(source) is read_annotations(source)  # read once
    (tmp_path / "gt.txt").write_text(WIDER + "c.jpg\n1\n1 1 5 5 0 0 0 0 0 0\n")
    assert read_annotations(source).counts.tolist() == [0, 2, 1]


# ----------------------------------------------------------------------------- a hostile file


@pytest.mark.parametrize(
    "text,match",
    [
        ("a.jpg\n\u00b2\n1 2 3 4\n", r"line 2: expected the number of faces of a.jpg, got '\u00b2'"),  # int() refuses
        ("a.jpg\n\u0661\n1 2 3 4\n", r"line 2: expected the number of faces of a.jpg"),  # Arabic-Indic 1: int() takes
        ("a.jpg\n1\n\u0661 2 3 4\n", r"line 3: expected a face"),  # ... and float() takes it
        ("a.jpg\n1\n1_0 2 3 4\n", r"line 3: expected a face"),  # float() reads 1_0 as 10
        ("a.jpg\n1\n" + "9" * 400 + " 2 3 4\n", r"line 3: expected a face"),  # float(): inf
        ("a.jpg\n" + "9" * 5000 + "\n", r"line 2: expected the number of faces"),  # int(): past its 4300 digits
        ("a.jpg\n1\n70000 2 3 4\n", r"line 3: a face reaching 70003 px, beyond any image \(65,535 px at most\)"),
        ("a.jpg\n1\n1 2 3 1e308\n", r"line 3: a face reaching 1e\+308 px, beyond any image"),
    ],
)
def test_a_hostile_widerface_file_is_one_line_naming_the_line(tmp_path, text, match):
    refused(wider(tmp_path, text), match)


def test_a_bom_is_not_part_of_the_first_images_name(tmp_path):
    (tmp_path / "gt.txt").write_text("\ufeff" + WIDER, encoding="utf-8")
    assert read_annotations(f"widerface:{tmp_path / 'gt.txt'}").names[0] == "0--Parade/0_Parade_marchingband_1_849.jpg"
    (tmp_path / "c.json").write_text("\ufeff" + json.dumps(coco_json([2, 1])), encoding="utf-8")
    assert read_annotations(f"coco:{tmp_path / 'c.json'}").counts.tolist() == [2, 1]


def hostile_coco(tmp_path, image=None, bbox=None, edit=("", "")) -> str:
    """A COCO file of one 640 x 480 image and one box, the image's fields updated by ``image``, the box ``bbox``;
    ``edit``: (a text of the JSON, what replaces it), for what json.dumps cannot write."""
    data = {"images": [{"id": 1, "file_name": "a.jpg", "width": 640, "height": 480} | (image or {})]}
    data["annotations"] = [{"image_id": 1, "bbox": bbox or [10, 10, 50, 50], "iscrowd": 0}]
    (tmp_path / "c.json").write_text(json.dumps(data).replace(*edit) if edit[0] else json.dumps(data))
    return f"coco:{tmp_path / 'c.json'}"


OUTSIDE = r"annotations\[0\]\.bbox is \[{}\]: it lies wholly outside its image a.jpg \(640 x 480 px\)"


BIG = "9" * 400  # an integer JSON reads, and float() cannot take


@pytest.mark.parametrize(
    "image,bbox,edit,match",
    [
        (None, [900, 700, 50, 50], ("", ""), OUTSIDE.format("900, 700, 50, 50")),  # past the right and the bottom
        (None, [640, 10, 5, 5], ("", ""), OUTSIDE.format("640, 10, 5, 5")),  # starts on the right edge: no pixel in
        (None, [-60, 10, 50, 50], ("", ""), OUTSIDE.format("-60, 10, 50, 50")),  # ends left of the image
        (None, [10, -50, 50, 50], ("", ""), OUTSIDE.format("10, -50, 50, 50")),  # ends on the top edge
        (None, [10, 10, 1e308, 50], ("", ""), r"bbox is \[10, 10, 1e\+308, 50\] in a.jpg: a box 1e\+308 x 50 px, lar"),
        ({"width": 1e-300}, None, ("", ""), r"images\[0\]\.width is 1e-300, expected a number of pixels in \[1, 65,53"),
        ({"height": 1e308}, None, ("", ""), r"images\[0\]\.height is 1e\+308, expected a number of pixels in \[1, "),
        ({"width": 0.5}, None, ("", ""), r"images\[0\]\.width is 0.5, expected a number of pixels in \[1,"),
        (None, None, ("[10, 10", f"[{BIG}, 10"), r"annotations\[0\]\.bbox is \[9999\S+\.\.\., expected \[x, y, w"),
        (None, None, ('"width": 640', f'"width": {BIG}'), r"images\[0\]\.width is 9999\S+\.\.\., expected a numbe"),
        (None, None, ("[10, 10, 50, 50]", "[" * 100_000 + "]" * 100_000), r"c.json nests lists or objects thousands"),
    ],
    ids=["outside", "on-the-edge", "left", "above", "1e308-wide", "1e-300-image", "1e308-image", "half-pixel-image"]
    + ["400-digit-x", "400-digit-width", "100000-deep"],
)
def test_a_hostile_coco_file_is_one_line_naming_the_image_and_the_field(tmp_path, image, bbox, edit, match):
    source = hostile_coco(tmp_path, image, bbox, edit)
    assert refused(source, match).startswith(f"data.boxes={source}: ")


def test_a_box_partly_outside_its_image_is_clipped_to_it_and_counted(tmp_path):
    source = hostile_coco(tmp_path, bbox=[600, -20, 100, 70])  # 40 px past the right, 20 above
    found = read_annotations(source)
    assert found.boxes.tolist() == [[600, 0, 40, 50]] and found.clipped == 1
    assert "1 image, 1 box (1–1 an image, 1.0 on average, 0 images without any); 1 box partly outside the image " in (
        describe(found, 8, "truncate")
    )
    assert fit_boxes(found, 64, 8).of(0).tolist() == [[60, 0, 63, 6]]  # 600/640*64 = 60; ceil(50/480*64) - 1 = 6
    inside = read_annotations(hostile_coco(tmp_path, bbox=[0, 0, 0, 0]))  # a point in the corner: inside, kept
    assert (
        inside.clipped == 0 and inside.boxes.tolist() == [[0, 0, 0, 0]] and "clipped" not in describe(inside, 8, "fit")
    )


# ----------------------------------------------------------------------------- the slots


def crowded(tmp_path):
    """Four images: 3 faces, none, 7 faces (one of them the largest), 2 faces."""
    text = widerface_text([3, 0, 7, 2], seed=1)
    lines = text.splitlines()
    at = lines.index("7") + 4  # the third face of the crowd: the largest of all
    lines[at] = "100 100 600 600 0 0 0 0 0 0"
    return read_annotations(wider(tmp_path, "\n".join(lines) + "\n"))


def test_truncate_keeps_the_largest_boxes_in_canonical_order_and_counts_what_it_dropped(tmp_path):
    found = crowded(tmp_path)
    fitted = fit_boxes(found, 64, 4)
    assert (fitted.truncated, fitted.dropped) == (1, 3) and found.over(4) == (1, 3)
    kept = fitted.of(2).astype(int)
    assert len(kept) == 4 and [len(fitted.of(i)) for i in range(4)] == [3, 0, 4, 2]
    whole = fit_boxes(found, 64, 7).of(2).astype(int)
    area = lambda b: (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)  # noqa: E731
    assert sorted(area(kept).tolist()) == sorted(area(whole).tolist())[-4:]  # the four largest of the seven
    assert [6, 6, 43, 43] in kept.tolist()  # the 600 px face: 100/1024*64 = 6.25 -> 6, ceil(700/1024*64) - 1 = 43
    centre = kept[:, 0] + kept[:, 2]
    assert np.all(np.diff(centre) >= 0)  # canonical: left to right by the centre's x
    assert np.all(kept[:, 2] >= kept[:, 0]) and kept.max() <= 63


def test_the_slots_rule(tmp_path):
    found = crowded(tmp_path)
    assert slots_for(found, 4, "truncate") == 4
    assert slots_for(found, 4, "fit") == 7 and slots_for(found, 100, "fit") == 7  # fit: from the data, both ways
    assert slots_for(found, 7, "refuse") == 7
    with pytest.raises(AnnotationError, match=r"1 image over data.max_boxes=4 \(the most: 7, 2--"):
        slots_for(found, 4, "refuse")
    assert "1 image over data.max_boxes=4: 3 boxes dropped, the smallest of each" in describe(found, 4, "truncate")
    assert "none holds more than data.max_boxes=7" in describe(found, 7, "truncate")
    assert "4 images, 12 boxes (0–7 an image, 3.0 on average, 1 image without any)" in describe(found, 7, "fit")


def test_a_file_of_empty_images_fits_one_slot(tmp_path):
    found = read_annotations(wider(tmp_path, "a.jpg\n0\n0 0 0 0 0 0 0 0 0 0\nb.jpg\n0\n"))
    assert found.counts.tolist() == [0, 0] and slots_for(found, 256, "fit") == 1
    fitted = fit_boxes(found, 32, 1)
    assert fitted.boxes.shape == (0, 4) and fitted.offsets.tolist() == [0, 0, 0]


def test_the_generated_widerface_shaped_file(tmp_path):
    counts = widerface_counts(images=500, seed=3)
    assert np.mean(counts <= 20) > 0.99 and np.sum(counts > 500) == 4 and 4 < np.mean(counts[counts <= 20]) < 8
    found = read_annotations(f"widerface:{write_widerface(tmp_path / 'wf.txt', counts, seed=3)}")
    assert found.counts.tolist() == counts.tolist()


def test_a_new_format_is_its_reader_and_one_entry_in_formats(tmp_path, monkeypatch):
    """data.boxes's prefixes, the refusal's list of them and the reader each picks come from FORMATS alone."""

    def read_lines(path, source):  # one image of 10 x 10 px per line, holding the line's one box
        rows = [[float(v) for v in line.split()] for line in path.read_text().splitlines()]
        sizes, counts = np.full((len(rows), 2), 10.0), np.ones(len(rows), dtype=np.int64)
        return Annotations(source, [f"line {i + 1}" for i in range(len(rows))], sizes, np.array(rows), counts)

    monkeypatch.setitem(annotations.FORMATS, "lines", Format("<boxes.txt>", read_lines))
    (tmp_path / "boxes.txt").write_text("1 2 3 4\n0 0 5 5\n")
    found = read_annotations(f"lines:{tmp_path / 'boxes.txt'}")
    assert found.images == 2 and found.boxes.tolist() == [[1, 2, 3, 4], [0, 0, 5, 5]]
    with pytest.raises(AnnotationError, match=r"allowed synthetic, coco:<instances.json>, .*, lines:<boxes.txt>$"):
        parse_source("voc:x.xml")
