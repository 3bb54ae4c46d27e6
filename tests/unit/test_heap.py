import gc

from recserve.backends.base.heap import freeze_startup_heap


def test_what_is_alive_at_start_is_frozen_and_later_objects_are_not():
    before = [[] for _ in range(1000)]  # containers alive at "start"
    assert gc.get_freeze_count() == 0
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= 1000
        later = [[] for _ in range(100)]  # containers made after the start stay collectable
        assert gc.get_freeze_count() == frozen
        assert any(gc.is_tracked(item) for item in later)
    finally:
        gc.unfreeze()
    assert before
