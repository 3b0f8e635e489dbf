"""(being written)"""

import quart

bp = quart.Blueprint("openai", __name__)
