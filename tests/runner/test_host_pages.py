"""runner/host_pages.py: page-aligned reservations, and releases that drop only pages wholly inside the rows."""

import torch

from pagellm.runner.host_pages import PAGE, HostPages, page_aligned_empty, row_runs


def test_row_runs_coalesce_consecutive_rows():
    assert row_runs([9, 3, 5, 4]) == [(3, 6), (9, 10)]
    assert row_runs([]) == []


def test_tensors_start_on_a_page_and_keep_shape_and_dtype():
    t = page_aligned_empty((5, 16, 1, 256), torch.float16)
    assert t.data_ptr() % PAGE == 0 and t.shape == (5, 16, 1, 256) and t.dtype == torch.float16
    assert t.is_contiguous()


def test_release_zeroes_whole_page_rows_and_spares_the_others():
    rows = page_aligned_empty((6, PAGE // 4), torch.float32)  # one page a row
    rows.fill_(7.0)
    pages = HostPages([rows])
    assert pages.release([1, 2, 4]) == 3 * PAGE
    assert rows[[1, 2, 4]].eq(0).all() and rows[[0, 3, 5]].eq(7).all()
    assert pages.released_bytes_total == 3 * PAGE


def test_rows_smaller_than_a_page_release_only_pages_they_fill():
    rows = page_aligned_empty((8, PAGE // 8), torch.float16)  # four rows a page
    rows.fill_(1.0)
    pages = HostPages([rows])
    assert pages.release([1, 2, 3]) == 0  # the first page also holds row 0, which lives on
    assert rows.eq(1).all()
    assert pages.release([4, 5, 6, 7]) == PAGE  # the second page, whole
    assert rows[4:].eq(0).all() and rows[:4].eq(1).all()
