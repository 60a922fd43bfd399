"""The context axis: sequences split over devices, `attention` over them, and the checks a split step runs."""
