"""Short records for structured output, as users send them: reviews to classify, orders to extract from.

Each set is the three template parameters a user would set (system prompt,
prompt template, response schema) and the plain-text records of the stream.
Used by ``make bench-structured`` and by the structured end-to-end test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RecordSet:
    name: str
    system_prompt: str
    prompt_template: str
    schema: dict
    records: tuple[str, ...]

    def template_args(self) -> list[str]:
        return [f"--system_prompt={self.system_prompt}", f"--prompt_template={self.prompt_template}",
                f"--response_schema={json.dumps(self.schema)}"]


REVIEWS = RecordSet(
    "review sentiment", "You label customer reviews.", "Review: {text}",
    {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars"],
     "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                    "stars": {"type": "integer", "minimum": 1, "maximum": 5}}},
    ("Arrived broken and support never answered.", "Exactly as described, works perfectly.",
     "It's fine. Does the job, nothing special.", "Terrible battery life, returned it after a week.",
     "Best purchase I've made this year!", "The color is a bit different from the photo.",
     "Stopped working after two days.", "Great value for the price, would buy again.",
     "Shipping took a month.", "Comfortable, but the size runs small.",
     "Loud, cheap plastic, and it smells.", "My kids love it.", "Average quality, average price.",
     "Instructions were missing but I figured it out.", "Five stars, fast delivery and great packaging.",
     "Worst customer service ever.", "Does what it says.", "The lid cracked on the first wash.",
     "Beautiful design and very sturdy.", "Not worth the money.", "Okay for occasional use.",
     "Exceeded my expectations in every way.", "The app keeps crashing.", "Smaller than expected but cute.",
     "Replaced my old one, much better.", "Came late and with a dent.", "Perfect gift for my mother.",
     "Neither good nor bad.", "Flimsy zipper, broke in a week.", "Would recommend to anyone."))

ORDERS = RecordSet(
    "order extraction", "You extract order details as JSON.", "Order note: {text}",
    {"type": "object", "additionalProperties": False, "required": ["customer", "city", "quantity"],
     "properties": {"customer": {"type": "string", "maxLength": 40},
                    "city": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10000}}},
    ("Jane Doe ordered 3 lamps, ship to Berlin.", "Send 12 mugs to Carlos Ruiz in Madrid.",
     "Ahmed Khan, Cairo: 1 desk.", "2 chairs for Mei Lin, Shanghai.", "Olga Petrova wants 5 kettles in Moscow.",
     "Deliver 7 books to Tom Smith, London.", "Priya Patel, Mumbai, 4 pillows.",
     "Lucas Martin ordered 10 plates for Paris.", "1 sofa to Anna Rossi in Rome.",
     "Kenji Sato, Tokyo, 6 cups.", "Ship 2 rugs to Sara Cohen, Tel Aviv.", "Ivan Horvat ordered 8 pens, Zagreb.",
     "Fatima Zahra, Rabat: 3 towels.", "9 candles for Emma Jones in Sydney.", "Noah Brown, Toronto, 2 tables.",
     "Lea Müller wants 4 vases sent to Vienna.", "Send 15 forks to Diego Silva, Lisbon.",
     "Yuki Tanaka, Osaka: 1 mirror.", "Omar Haddad ordered 6 bowls for Beirut.",
     "Chloe Dubois, Lyon, 3 blankets.", "11 spoons to Ali Demir in Istanbul.", "Grace Kim, Seoul, 2 lamps.",
     "Pedro Alves ordered 5 shelves, Porto.", "Nina Berg, Oslo: 4 frames.", "Send 20 cups to John Lee, Boston."))

RECORD_SETS = (REVIEWS, ORDERS)
