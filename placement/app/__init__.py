"""Commands built on the layers below: :mod:`~placement.app.verify` (check files) and
:mod:`~placement.app.show` (draw a placement)."""
