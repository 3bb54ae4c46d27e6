"""The closed loop's processes after serving: the joiner (``recserve join``) of logged rows and feedback."""
