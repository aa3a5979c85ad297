"""Text for tests: training-like prompts and filler for the demo model and the task builders."""

# Pride and Prejudice, chapter 1 (public domain): training-like text for prompts and filler.
AUSTEN = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must "
    "be in want of a wife.\n\nHowever little known the feelings or views of such a man may be on his "
    "first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding "
    "families, that he is considered the rightful property of some one or other of their daughters.\n\n"
    "\"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park is let "
    "at last?\"\n\nMr. Bennet replied that he had not.\n\n\"But it is,\" returned she; \"for Mrs. Long has "
    "just been here, and she told me all about it.\"\n\nMr. Bennet made no answer.\n\n\"Do you not want "
    "to know who has taken it?\" cried his wife impatiently.\n\n\"You want to tell me, and I have no "
    "objection to hearing it.\"\n\nThis was invitation enough.\n\n")
