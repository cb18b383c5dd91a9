"""The small Python packages ``repo_tasks`` generates its bug-fix tasks from: modules, their tests, and the bugs.

Each ``Unit`` is one module of a package ``pkg`` with its ``unittest`` tests, and the bugs that can be put in it:
``(kind, correct text, buggy text)``, the correct text found exactly once in the module (``repo_tasks`` checks it,
and the suite checks that every bug fails a test and the correct module passes them all). A task's repository
holds the buggy module and ``size - 1`` other modules, correct, with all their tests.

Kinds of bug (``KINDS``): ``off_by_one``, ``wrong_operator``, ``wrong_comparison`` and ``wrong_value`` for training
and held-out tasks; ``missing_guard`` (an edge case's check removed) and ``swapped_args`` (two arguments or operands
swapped) only out of distribution.
Nothing here runs code: the environment does, in the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAIN_KINDS = ("off_by_one", "wrong_operator", "wrong_comparison", "wrong_value")
HELDOUT_UNITS = ("dates", "grid")
"""Modules whose bugs are held out (the held-out split: code never trained on, kinds of bug that were)."""
OOD_KINDS = ("missing_guard", "swapped_args")
KINDS = TRAIN_KINDS + OOD_KINDS


@dataclass(frozen=True)
class Unit:
    name: str
    source: str
    tests: str
    bugs: tuple[tuple[str, str, str], ...]
    """``(kind, correct text, buggy text)``: the bug replaces the one place the module holds the correct text."""


UNITS = (
    Unit("stats", '''"""Summary statistics of lists of numbers."""


def mean(xs):
    if not xs:
        raise ValueError("mean of an empty list")
    return sum(xs) / len(xs)


def median(xs):
    ordered = sorted(xs)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def value_range(xs):
    return max(xs) - min(xs)
''', '''import unittest

from pkg.stats import mean, median, value_range


class StatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)

    def test_mean_empty(self):
        with self.assertRaises(ValueError):
            mean([])

    def test_median_odd(self):
        self.assertEqual(median([5, 1, 3]), 3)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_value_range(self):
        self.assertEqual(value_range([3, 9, 4]), 6)
''', (("wrong_operator", "    return max(xs) - min(xs)", "    return max(xs) + min(xs)"),
      ("off_by_one", "    return (ordered[middle - 1] + ordered[middle]) / 2",
       "    return (ordered[middle] + ordered[middle + 1]) / 2"),
      ("missing_guard", "    if not xs:\n        raise ValueError(\"mean of an empty list\")\n", ""))),

    Unit("text", '''"""Small helpers over strings."""


def word_count(text):
    return len(text.split())


def title_words(text):
    return " ".join(word[:1].upper() + word[1:] for word in text.split(" "))


def is_palindrome(text):
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def repeat(text, times, separator):
    return separator.join([text] * times)
''', '''import unittest

from pkg.text import is_palindrome, repeat, title_words, word_count


class TextTest(unittest.TestCase):
    def test_word_count(self):
        self.assertEqual(word_count("one two  three"), 3)

    def test_title_words(self):
        self.assertEqual(title_words("hello big world"), "Hello Big World")

    def test_palindrome(self):
        self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))
        self.assertFalse(is_palindrome("python"))

    def test_repeat(self):
        self.assertEqual(repeat("ab", 3, "-"), "ab-ab-ab")
''', (("wrong_value", "    return \" \".join(word[:1].upper() + word[1:] for word in text.split(\" \"))",
       "    return \" \".join(word[:1].upper() + word[2:] for word in text.split(\" \"))"),
      ("off_by_one", "    return letters == letters[::-1]", "    return letters[1:] == letters[::-1]"),
      ("swapped_args", "    return separator.join([text] * times)", "    return text.join([separator] * times)"))),

    Unit("intervals", '''"""Closed intervals as (start, end) pairs."""


def overlaps(a, b):
    return a[0] <= b[1] and b[0] <= a[1]


def merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals):
    return sum(end - start for start, end in merge(intervals))
''', '''import unittest

from pkg.intervals import merge, overlaps, total_length


class IntervalsTest(unittest.TestCase):
    def test_overlaps(self):
        self.assertTrue(overlaps((1, 3), (3, 5)))
        self.assertFalse(overlaps((1, 2), (4, 5)))

    def test_merge(self):
        self.assertEqual(merge([(5, 7), (1, 3), (2, 4)]), [(1, 4), (5, 7)])

    def test_merge_touching(self):
        self.assertEqual(merge([(1, 2), (2, 3)]), [(1, 3)])
        self.assertEqual(merge([(1, 10), (2, 3)]), [(1, 10)])

    def test_total_length(self):
        self.assertEqual(total_length([(0, 2), (1, 4), (10, 11)]), 5)
''', (("wrong_comparison", "    return a[0] <= b[1] and b[0] <= a[1]", "    return a[0] < b[1] and b[0] < a[1]"),
      ("wrong_value", "            merged[-1] = (merged[-1][0], max(merged[-1][1], end))",
       "            merged[-1] = (merged[-1][0], end)"),
      ("wrong_operator", "    return sum(end - start for start, end in merge(intervals))",
       "    return sum(end + start for start, end in merge(intervals))"))),

    Unit("matrix", '''"""Matrices as lists of rows."""


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def transpose(rows):
    return [list(column) for column in zip(*rows)]


def trace(rows):
    return sum(rows[i][i] for i in range(len(rows)))


def scale(rows, factor):
    return [[factor * x for x in row] for row in rows]
''', '''import unittest

from pkg.matrix import identity, scale, trace, transpose


class MatrixTest(unittest.TestCase):
    def test_identity(self):
        self.assertEqual(identity(3), [[1, 0, 0], [0, 1, 0], [0, 0, 1]])

    def test_transpose(self):
        self.assertEqual(transpose([[1, 2, 3], [4, 5, 6]]), [[1, 4], [2, 5], [3, 6]])

    def test_trace(self):
        self.assertEqual(trace([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), 15)

    def test_scale(self):
        self.assertEqual(scale([[1, 2], [3, 4]], 3), [[3, 6], [9, 12]])
''', (("off_by_one", "    return sum(rows[i][i] for i in range(len(rows)))",
       "    return sum(rows[i][i] for i in range(len(rows) - 1))"),
      ("wrong_value", "    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]",
       "    return [[1 if i == j else 0 for j in range(n)] for i in range(n - 1)]"),
      ("wrong_operator", "    return [[factor * x for x in row] for row in rows]",
       "    return [[factor + x for x in row] for row in rows]"))),

    Unit("money", '''"""Amounts of money in cents."""


def add_tax(cents, percent):
    return cents + cents * percent // 100


def split_bill(cents, people):
    if people <= 0:
        raise ValueError("a bill is split between at least one person")
    share, rest = divmod(cents, people)
    return [share + 1 if i < rest else share for i in range(people)]


def discount(cents, percent):
    return cents - cents * percent // 100
''', '''import unittest

from pkg.money import add_tax, discount, split_bill


class MoneyTest(unittest.TestCase):
    def test_add_tax(self):
        self.assertEqual(add_tax(1000, 20), 1200)

    def test_split_bill(self):
        self.assertEqual(split_bill(1000, 3), [334, 333, 333])
        self.assertEqual(sum(split_bill(1001, 4)), 1001)

    def test_split_bill_nobody(self):
        with self.assertRaises(ValueError):
            split_bill(100, 0)

    def test_discount(self):
        self.assertEqual(discount(2000, 25), 1500)
''', (("wrong_comparison", "    return [share + 1 if i < rest else share for i in range(people)]",
       "    return [share + 1 if i <= rest else share for i in range(people)]"),
      ("wrong_operator", "    return cents + cents * percent // 100", "    return cents - cents * percent // 100"),
      ("missing_guard", "    if people <= 0:\n        raise ValueError(\"a bill is split between at least one "
                        "person\")\n", ""))),

    Unit("search", '''"""Searching sorted lists."""


def binary_search(xs, target):
    low, high = 0, len(xs) - 1
    while low <= high:
        middle = (low + high) // 2
        if xs[middle] == target:
            return middle
        if xs[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


def count_below(xs, limit):
    return sum(1 for x in xs if x < limit)


def largest(xs):
    best = xs[0]
    for x in xs[1:]:
        if x > best:
            best = x
    return best
''', '''import unittest

from pkg.search import binary_search, count_below, largest


class SearchTest(unittest.TestCase):
    def test_found(self):
        self.assertEqual(binary_search([1, 3, 5, 7, 9, 11], 9), 4)
        self.assertEqual(binary_search([1, 3, 5, 7, 9, 11], 1), 0)
        self.assertEqual(binary_search([1, 3, 5, 7, 9, 11], 7), 3)
        self.assertEqual(binary_search([1, 3, 5, 7, 9, 11], 11), 5)

    def test_missing(self):
        self.assertEqual(binary_search([1, 3, 5], 4), -1)

    def test_count_below(self):
        self.assertEqual(count_below([1, 5, 5, 8], 5), 1)

    def test_largest(self):
        self.assertEqual(largest([3, 8, 2, 8, 1]), 8)
        self.assertEqual(largest([-4, -2, -7]), -2)
''', (("wrong_comparison", "    while low <= high:", "    while low < high:"),
      ("wrong_comparison", "    return sum(1 for x in xs if x < limit)", "    return sum(1 for x in xs if x <= limit)"),
      ("off_by_one", "            low = middle + 1", "            low = middle + 2"),
      ("wrong_value", "    best = xs[0]", "    best = 0"))),

    Unit("dates", '''"""Calendar arithmetic (the Gregorian calendar)."""


def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if month == 2:
        return 29 if is_leap(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def day_of_year(year, month, day):
    return sum(days_in_month(year, m) for m in range(1, month)) + day
''', '''import unittest

from pkg.dates import day_of_year, days_in_month, is_leap


class DatesTest(unittest.TestCase):
    def test_leap(self):
        self.assertTrue(is_leap(2024))
        self.assertTrue(is_leap(2000))
        self.assertFalse(is_leap(1900))

    def test_days_in_month(self):
        self.assertEqual(days_in_month(2023, 2), 28)
        self.assertEqual(days_in_month(2024, 2), 29)
        self.assertEqual(days_in_month(2024, 4), 30)

    def test_day_of_year(self):
        self.assertEqual(day_of_year(2024, 3, 1), 61)
        self.assertEqual(day_of_year(2023, 1, 5), 5)
''', (("wrong_operator", "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
       "    return year % 4 == 0 and (year % 100 != 0 and year % 400 == 0)"),
      ("off_by_one", "    return sum(days_in_month(year, m) for m in range(1, month)) + day",
       "    return sum(days_in_month(year, m) for m in range(1, month + 1)) + day"),
      ("swapped_args", "        return 29 if is_leap(year) else 28", "        return 28 if is_leap(year) else 29"))),

    Unit("roman", '''"""Roman numerals."""

NUMERALS = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
            (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))


def to_roman(number):
    if number <= 0:
        raise ValueError("Roman numerals start at 1")
    out = []
    for value, letters in NUMERALS:
        while number >= value:
            out.append(letters)
            number -= value
    return "".join(out)


def from_roman(text):
    values = {letters: value for value, letters in NUMERALS if len(letters) == 1}
    total = 0
    for i, letter in enumerate(text):
        value = values[letter]
        if i + 1 < len(text) and values[text[i + 1]] > value:
            total -= value
        else:
            total += value
    return total
''', '''import unittest

from pkg.roman import from_roman, to_roman


class RomanTest(unittest.TestCase):
    def test_to_roman(self):
        self.assertEqual(to_roman(1994), "MCMXCIV")
        self.assertEqual(to_roman(3), "III")

    def test_to_roman_zero(self):
        with self.assertRaises(ValueError):
            to_roman(0)

    def test_from_roman(self):
        self.assertEqual(from_roman("MCMXCIV"), 1994)
        self.assertEqual(from_roman("XL"), 40)
''', (("wrong_comparison", "        while number >= value:", "        while number > value:"),
      ("wrong_operator", "            total -= value", "            total += value"),
      ("missing_guard", "    if number <= 0:\n        raise ValueError(\"Roman numerals start at 1\")\n", ""))),

    Unit("inventory", '''"""A stock of items by name."""


class Inventory:
    def __init__(self):
        self.counts = {}

    def add(self, name, count=1):
        self.counts[name] = self.counts.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.counts.get(name, 0)
        if count > have:
            raise KeyError(f"only {have} of {name}")
        self.counts[name] = have - count

    def total(self):
        return sum(self.counts.values())
''', '''import unittest

from pkg.inventory import Inventory


class InventoryTest(unittest.TestCase):
    def test_add_and_total(self):
        stock = Inventory()
        stock.add("apple", 3)
        stock.add("pear")
        self.assertEqual(stock.total(), 4)

    def test_remove(self):
        stock = Inventory()
        stock.add("apple", 3)
        stock.remove("apple", 3)
        self.assertEqual(stock.counts["apple"], 0)

    def test_remove_too_many(self):
        stock = Inventory()
        stock.add("apple", 1)
        with self.assertRaises(KeyError):
            stock.remove("apple", 2)
''', (("wrong_comparison", "        if count > have:", "        if count >= have:"),
      ("wrong_value", "        self.counts[name] = self.counts.get(name, 0) + count",
       "        self.counts[name] = self.counts.get(name, 0) + 1"),
      ("wrong_operator", "        self.counts[name] = have - count", "        self.counts[name] = have + count"))),

    Unit("grid", '''"""Cells of a grid as (row, column) pairs."""


def in_bounds(cell, rows, columns):
    return 0 <= cell[0] < rows and 0 <= cell[1] < columns


def neighbours(cell, rows, columns):
    row, column = cell
    steps = ((-1, 0), (1, 0), (0, -1), (0, 1))
    return [(row + dr, column + dc) for dr, dc in steps if in_bounds((row + dr, column + dc), rows, columns)]


def manhattan(a, b):
    return abs(a[0] - b[0]) + abs(a[1] - b[1])
''', '''import unittest

from pkg.grid import in_bounds, manhattan, neighbours


class GridTest(unittest.TestCase):
    def test_in_bounds(self):
        self.assertTrue(in_bounds((0, 2), 3, 3))
        self.assertFalse(in_bounds((3, 0), 3, 3))

    def test_neighbours(self):
        self.assertEqual(sorted(neighbours((0, 0), 3, 3)), [(0, 1), (1, 0)])
        self.assertEqual(len(neighbours((1, 1), 3, 3)), 4)
        self.assertEqual(sorted(neighbours((1, 3), 2, 4)), [(0, 3), (1, 2)])

    def test_manhattan(self):
        self.assertEqual(manhattan((1, 2), (4, 0)), 5)
''', (("wrong_comparison", "    return 0 <= cell[0] < rows and 0 <= cell[1] < columns",
       "    return 0 <= cell[0] <= rows and 0 <= cell[1] <= columns"),
      ("wrong_operator", "b[0]) + abs(a[1]", "b[0]) - abs(a[1]"),
      ("swapped_args", "column + dc), rows, columns)", "column + dc), columns, rows)"))),
)
