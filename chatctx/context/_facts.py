"""Facts a running summary must keep, found with no model.

Three kinds:

- **Identifiers** a support conversation must not lose: order and ticket numbers, product
  models, amounts, e-mail addresses, capitalized names people introduce themselves with.
- **Statements the user makes about themselves**, the way people say them in chat: lower case,
  contractions, typos ("im"), said in passing ("oh and I can't have gluten"). A sentence
  counts when it speaks in the first person and says something durable: health and diet,
  names of people and pets, family, home and origin, work and study, belongings and where they
  were left, plans and dates, preferences, open requests. Transient chat ("lol ok", "im tired")
  does not.
- **Minor facts**: any other user sentence that names something specific (a word outside
  everyday chat vocabulary: "propranolol", "Poughkeepsie", "bouldering"), or speaks about
  the speaker with content words, if its words are rare enough in everyday chat to tell
  something; the rarer, the more it is worth. A recognized statement with nothing specific
  in it, no number, date or name ("i really like tacos") scores lower, and may become minor.

The patterns are general English, not tuned to a data set; every function is pure and
deterministic. Facts are compared as parsed sets (:func:`fact_set`), never by substring.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files

from chatctx.model.words import words as word_list
from chatctx.store.search import STOPWORDS, query_terms, unspaced

FACTS_PREFIX = "Facts: "

# Identifiers: order/ticket numbers and models (NH-48213, T-7781, AX3000, 4K55), #refs,
# long numbers, amounts, e-mail addresses.
# Bounded by anything but a Latin letter or digit: in Chinese, Japanese or Korean an identifier
# sits between letters of the sentence ("订单号是DM7720135946一共", "번호는A-4821이고").
_IDENTIFIER = re.compile(
    r"(?<![A-Za-z0-9_])(?:[A-Z]{1,6}-?[A-Z]*\d[A-Za-z0-9_-]*|\d+[A-Z][A-Za-z0-9_-]*"
    r"|#\d[A-Za-z0-9_-]*|\d{4,})(?![A-Za-z0-9_])"
    r"|[$€£]\s?\d+(?:[,.]\d+)*|(?<![A-Za-z0-9À-ÿ._%+-])[A-Za-z0-9À-ÿ._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+(?![A-Za-z0-9-])"
)
# Values written the same way in any language: times, dates, phone numbers and grouped amounts
# (14:30, 3/14, 090-4418-2275, 38,000), and a number joined to a letter of a script other than
# Latin, its unit ("38,000원", "10시", "3月14日", "5号"; one letter: the rest of the run is
# the sentence). The longer of overlapping matches counts (``identifiers``).
_VALUE = re.compile(r"\d+(?:[-:/.,]\d+)+(?:(?![A-Za-z])[^\W\d_])?|\d+(?![A-Za-z])[^\W\d_]")
# A name set off by quotation marks, in any script's ("el plan 'Óptimo'", 「らくらくパック」,
# “居民峰谷分时电价”, «Plan Óptimo», '완전자차 프리미엄'); an ASCII apostrophe only where no
# Latin letter touches it outside ("don't", "the kids' toys" hold none).
_QUOTED = re.compile(
    r"[「『“«]([^「」『』“”«»\n]{2,40})[」』”»]|\"([^\"\n]{2,40})\""
    r"|(?<![A-Za-z])'([^'\n]{2,40})'(?![A-Za-z])"
)
# Capitalized words after a sentence's first ("Ramiro Esquivel", "EpiPen", "Varberg"): names,
# in languages other than English (English has its own rules below).
_CAPITALIZED = re.compile(
    r"(?<=[^\s.!?¿¡]\s)[A-Z][A-Za-zÀ-ÿ]*[a-zà-ÿ](?:\s[A-Z][A-Za-zÀ-ÿ]*[a-zà-ÿ])*"
)
_DIGITS = re.compile(r"\d+")
# What ``replaced`` reads next to a value: terms on each side, characters where no spaces.
NEAR_TERMS, NEAR_CHARS = 2, 8
NEAR_SPAN = 80  # characters read on each side at most: the cost stays linear in a long text
_CLAUSE_MARK = re.compile(r"[,;:.!?\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f\u061f\u060c]")
# People introducing themselves with a capitalized name: "my name is Maria Lopez", "I'm Jonas".
_INTRODUCED = re.compile(
    r"\b(?:[Mm]y name is|[Nn]ame's|I am|I'm|[Tt]his is|[Cc]all me)\s+"
    r"([A-Z][a-z]+(?:\s[A-Z][a-z]+)?)\b"
)
# Sentence ends, not abbreviations ("St. Mary's", "Dr. Lee", "Apt. 4").
_SENTENCE = re.compile(
    r"(?<=[.!?])(?<!\b[Ss]t\.)(?<!\b[Mm]r\.)(?<!\b[Dd]r\.)(?<!\b[Mm]s\.)(?<!\b[Mm]rs\.)"
    r"(?<!\b[Jj]r\.)(?<!\b[Aa]pt\.)(?<!\b[Aa]ve\.)(?<!\b[Nn]o\.)(?<!\b[Vv]s\.)\s+"
    r"|(?<=[\u3002\uff01\uff1f])\s*|\n+"  # Chinese and Japanese end a sentence without a space
)
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'"})
_I = re.IGNORECASE

# The speaker talking about themselves (or their household).
_ANCHOR = re.compile(
    r"\b(?:i|i'm|im|i'd|i've|ive|i'll|me|my|mine|myself|we|we're|we've|we'll|our|ours|us)\b"
)
# Words before the first person that carry nothing: "oh and", "btw", "haha yeah so"; whole
# words only ("yesterday" does not start with "yes", nor "Andrew" with "and").
_LEAD = re.compile(
    r"^(?:(?:oh|and|also|btw|by the way|anyway|anyways|well|haha\w*|lol|lmao|yeah|yea|yes|"
    r"yep|ok|okay|um+|uh+|hmm+|but|plus|oh yeah|actually|fyi|ps|just so you know|honestly|"
    r"tbh|literally|basically|random(?:ly)?|fun fact|true|totally|"
    r"speaking of which|random but|side note)\b[\s,.!:;-]*)+",
    _I,
)
_TRAIL = re.compile(
    r"(?:[\s,]+(?:lol|haha\w*|lmao|btw|though|tho|anyway|:\)|:d|:p|xd|hehe))+[\s.!]*$", _I
)
_QUESTION = re.compile(
    r"\?\s*$|^(?:what|where|when|who|whom|whose|which|how|why|do|does|did|can|could|would|"
    r"will|should|is|are|am|was|were|have|has|remind me|any idea)\s"
)
_NOT_OBJECT = (
    r"(?!(?:it|that|this|those|these|them|you|him|her|u|ur|yours?|me|so|too|i|we|im|i'm|when|"
    r"how|what|a lot|to think|to say)\b)"
)
_NUMWORD = (
    r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|"
    r"fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|"
    r"eighty|ninety|hundred|thousand|first|second|third|fourth|fifth|sixth|seventh|eighth|"
    r"ninth|tenth|dozen)"
)
_RELATIVE = (
    r"(?:wife|husband|spouse|partner|boyfriend|girlfriend|bf|gf|fianc[eé]e?|sons?|daughters?|"
    r"kids?|children|child|baby|babies|twins?|mom|mum|mommy|mother|dad|daddy|father|parents|"
    r"sisters?|brothers?|sis|bro|siblings?|step\w+|grandma|grandmother|granny|nana|grandpa|"
    r"grandfather|grandparents|aunts?|auntie|uncles?|cousins?|nieces?|nephews?|in-laws?|"
    r"roommates?|room ?mates?|best friend|bff|family|fiance|friends?|teachers?|doctor|dentist|"
    r"therapist|coach|trainer|tutor|landlord|landlady|neighbou?rs?|vet|pastor|doc)"
)
_PET = (
    r"(?:dogs?|pupp(?:y|ies)|pups?|cats?|kittens?|kitty|pets?|hamsters?|parrots?|birds?|budgies?|"
    r"fish|goldfish|rabbits?|bunn(?:y|ies)|horses?|pony|turtles?|tortoises?|lizards?|geckos?|"
    r"snakes?|ferrets?|guinea pigs?|chinchillas?|hedgehogs?)"
)
_THING = (
    r"(?:car|truck|van|suv|bike|motorcycle|scooter|phone|laptop|computer|house|home|room|"
    r"apartment|flat|place|bag|backpack|suitcase|luggage|keys|wallet|watch|ring|guitar|piano|"
    r"camera|boat|locker|seat|desk|garden)"
)

# (kind, weight, pattern). The weight says how durable and useful the kind of fact is.
_CUES: tuple[tuple[str, float, re.Pattern[str]], ...] = (
    (
        "health",
        3.0,
        re.compile(
            r"\ballerg\w*|\bintoleran\w*|\banaphyla\w*|"
            r"\b(?:can'?t|cannot|can not|don'?t|do not|never|shouldn'?t|not allowed to)\s+"
            r"(?:eat|drink|touch)\b|\b(?:can'?t|cannot|can not|not allowed to)\s+have\s+"
            r"(?!(?:fun|time|it|that|this|you|kids|children|a|an|the|to|any\s+fun|much|enough|"
            r"everything|anything|nice|my|your)\b)\w+|"
            r"\b(?:vegan|vegetarian|veggie|pescatarian|celiac|coeliac|diabetic|diabetes|dairy|"
            r"insulin|asthma\w*|epi-?pens?|gluten|lactose|nut[- ]free|kosher|halal|sober|pregnant|"
            r"medications?|meds|prescriptions?|inhaler|blood type|migraines?|refill|hives|diet|"
            r"keto|paleo|fasting)\b|\bquit\s+(?:smoking|drinking|vaping|caffeine|sugar)\b|"
            r"\b(?:makes?|made)\s+me\s+(?:so\s+|really\s+|super\s+)?(?:sick|sleepy|drowsy|dizzy|"
            r"nauseous|itchy|itch|sneeze|break out|swell|throw up|puke)\b|"
            r"\b(?:does(?:n'?t| not)|never) agrees? with me\b",
        ),
    ),
    (
        "name",
        3.0,
        re.compile(
            r"\bnames?\s+(?:is|was|are)\b|\bname'?s\b|\bgoes by\b|\bnicknamed?\b|"
            r"\b(?:named|called)\s+(?!(?:me|you|him|her|them|us|back|it|out|off|in|up|my|the|a|"
            r"an|to|and|but|for|about|on|at|so|this|that)\b)\w+|"
            r"\bcall (?:him|her|them|it)\s+(?!(?:back|up|out|later|now)\b)\w+",
        ),
    ),
    (
        "whereabouts",
        3.0,
        re.compile(
            r"\bpark(?:ed|ing)\b|\bpark(?:ed)?\s+(?:on|in|at|by|near|next to|behind)\b|"
            r"\b(?:my|our|the)\s+(?:car|truck|bike|keys|key|wallet|phone|bag|van|jeep|suitcase|"
            r"luggage|passport|scooter|coat|glasses)(?:'s|\s+is|\s+are|\s+was|\s+were)\s+"
            r"(?:\w+\s+)?(?:on|in|at|by|near|under|behind|parked|sitting|inside)\b|"
            r"\b(?:left|put|keep|kept|stored?|locked|hid|dropped)\s+(?:my|the|our)\s+\w+"
            r"(?:\s\w+)?\s+(?:in|on|at|under|by|behind|near|next to|inside|with)\b|"
            r"\b(?:\d+(?:st|nd|rd|th)|" + _NUMWORD + r"|top|ground|bottom|basement)\s+"
            r"(?:floor|level|row|deck|story|storey)\b|"
            r"\b(?:level|floor|row|bay|section|aisle|space|spot|stall|deck|gate|platform|"
            r"terminal|locker|room|seat|table|cabin|unit|suite|box|slot)\s+"
            r"(?:[a-z]?\d+[a-z]?|" + _NUMWORD + r"|(?![ai]\b)[a-z])\b",
        ),
    ),
    (
        "home",
        2.5,
        re.compile(
            r"\b(?:i'?m|im|i am|we'?re|we are|originally|i come|we come|i came|we came)\s+from\b|"
            r"\blive[sd]?\s+(?:in|on|at|near|by|off|outside|with|right|just|downtown|here|there)\b|"
            r"\bback home\b|\bwhere (?:i|we)(?:'m| am|'re| are| live)\b|"
            r"\bliving\s+(?:in|on|at|near|with)\b|\bmov(?:ed|ing|e)\s+(?:to|into|in with)\b|"
            r"\bmoved\s+(?:here|there|away|over)?\s*from\b|\bcondo\b|\bhouse in\b|"
            r"\brent(?:ing)?\s+(?:a|an|my|our|the)\b|\bcommut\w+\b|\bstationed\b|"
            r"\bgrew up\b|\bborn\b|\bhometown\b|\baddress\b|\bapartment\b|\bapt\b|"
            r"\b(?:street|avenue|boulevard|st|ave|rd|blvd)\b|\b(?:zip|post(?:al)?)\s?code\b|"
            r"\bon\s+\w+\s+(?:lane|ln|road|drive|dr|court|ct|way|place|terrace|circle|row)\b|"
            r"\bneighbou?rhood\b|\bdorm\b",
        ),
    ),
    (
        "work",
        2.5,
        re.compile(
            r"\bwork(?:s|ed|ing)?\s+(?:as|at|for|in|from|nights|days|weekends|part[- ]time|"
            r"full[- ]time|remotely)\b|"
            r"\b(?:my|our)\s+(?:job|boss|office|company|employer|shift|manager|coworkers?|"
            r"co-workers?|colleagues?|clients?|business|career|salary|classes|class|professor|"
            r"major|degree|thesis|internship)\b|"
            r"\b(?:studying|study|studies|studied|majoring|majored|major)\s+(?:in|at)?\s*\w+|"
            r"\b(?:freshman|sophomore|junior|senior|graduate student|grad student|phd)\b|"
            r"\bgraduat(?:e|ed|ing)\b|\bretired\b|\bunemployed\b|\bintern(?:ship|ing)?\b|"
            r"\b(?:teach|teaches|teaching|taught)\s+\w+|"
            r"\b(?:i'?m|im|i am|i work)\s+in\s+(?:sales|marketing|accounting|finance|retail|it|hr|"
            r"tech|construction|healthcare|real estate|insurance|law|education|hospitality)\b|"
            r"\b(?:masters|master's|bachelors|bachelor's|doctorate|mba|residency|apprenticeship)\b|"
            r"\bvolunteer(?:s|ed|ing)?\b|\b(?:run|runs|own|owns|manage|manages)\s+(?:a|an|my|our)\s+"
            r"\w+|\b(?:speak|speaks|fluent in|native speaker|bilingual)\b|"
            r"\b(?:i'?m|im|i am)\s+(?:an?|the)\s+(?!(?:bit|little|lot|tad|big fan|huge fan|"
            r"fan|good|great|bad|little bit)\b)\w+",
        ),
    ),
    (
        "family",
        2.0,
        re.compile(r"\b(?:my|our)\s+(?:\w+\s+)?" + _RELATIVE + r"\b"),
    ),
    (
        "pet",
        2.0,
        re.compile(
            r"\b(?:my|our|a|an|two|three|four|\d)\s+(?:\w+\s+)?" + _PET + r"\b",
        ),
    ),
    (
        "possession",
        2.0,
        re.compile(
            r"\b(?:i|we|i'm|im|we're)\s+(?:\w+\s+)?(?:have|own|got|getting|bought|buying|adopted|"
            r"adopting|drive|ride|rent|lease)\s+"
            r"(?:a|an|two|three|four|\d+|my|this|the|some)\s+"
            r"(?!(?:question|headache|feeling|lot|few|good|great|bad|little|bit|test|idea|"
            r"problem|minute|second|moment|chance|look|hard|long|nice|fun|busy|rough|weird|"
            r"sense|clue|thing|way|time)\b)\w+|"
            r"\b(?:my|our)\s+(?:\w+\s+)?" + _THING + r"\s+(?:is|are|was|'s|has)\b",
        ),
    ),
    (
        "event",
        2.5,
        re.compile(
            r"\b(?:married|engaged|divorced|widowed|pregnant|expecting|"
            r"birthday|bday|b-day|anniversary|due date|graduation|wedding|funeral|"
            r"surgery|appointment|appt|interview|reservation|recital|exam|finals|dentist|"
            r"check-?up|haircut|physio|therapy session|check-?in|check-?out|"
            r"(?:class|lesson|practice|rehearsal|shift|lecture)\s+(?:at|on|starts|is at))\b|"
            r"\bdue\s+(?:on|by|in|at|next|this|tomorrow|today|friday|monday)\b",
        ),
    ),
    (
        "plan",
        2.0,
        re.compile(
            r"\b(?:fly(?:ing)?|flight|trip|travel\w*|vacation|holiday|honeymoon|cruise|"
            r"visit(?:ing)?|heading (?:to|out|back)|leav(?:e|ing) (?:for|on)|"
            r"plan(?:s|ning|ned)?\s+(?:to|on)\s+"
            + _NOT_OBJECT
            + r"\w+|booked|concert|tournament|move-in|moving|"
            r"training for|signed up for|race|marathon|competition)\b|"
            r"\b(?:can'?t wait|cant wait|so (?:stoked|excited|pumped)|looking forward to)\b",
        ),
    ),
    (
        # "going to X" is as often what the speaker does next minute as a plan: it takes a
        # date or a number to count.
        "intent",
        1.5,
        re.compile(
            r"\b(?:going|go|get|got) back to\b|"
            r"\bgoing to\s+(?!(?:be|bed|sleep|say|try|have|do|get|need|make|go|take|keep|let|"
            r"see|tell|ask|think|cry|die|lie)\b)\w+",
        ),
    ),
    (
        "preference",
        2.0,
        re.compile(
            r"\b(?:i|we|i've|ive|we've|i'd|we'd)\s+(?:\w+\s+)?(?:love|loved|like|enjoy|adore|hate|"
            r"dislike|detest|prefer|can'?t stand|cannot stand|am into|'m into|am obsessed with|"
            r"'m obsessed with|am a fan of|'m a fan of|'m a big fan of|am a big fan of|collect|"
            r"play|played|playing)\s+" + _NOT_OBJECT + r"\w+|"
            r"\b(?:best|greatest|worst)\s+(?:\w+\s+){0,2}(?:ever|in the world|of all time)\b|"
            r"\b(?:afraid|scared|terrified) of\b|\bphobia\b|"
            r"\b(?:don'?t|doesn'?t|do not) get along\b|"
            r"\bmy (?:jam|thing|weakness|guilty pleasure|fave)\b|\b(?:root|rooting|cheer) for\b|"
            r"\b\w+ fan\b|\bfan of\b|"
            r"\bobsessed with\b|\bcomfort food\b|\bon repeat\b|\bgo-?to\b|\bmy usual\b|"
            r"\b(?:a|an)\s+\w+\s+person\b",
        ),
    ),
    (
        "favourite",
        2.5,
        re.compile(r"\b(?:fav(?:ou?rite|e|s)?|fave)\b"),
    ),
    (
        "number",
        2.5,
        re.compile(
            r"\b(?:my|our)\s+(?:\w+\s+){0,2}(?:number|no\.?|#|code|size|pin|combo|combination|"
            r"extension|ext|license plate|plate)\b",
        ),
    ),
    (
        "age",
        2.5,
        re.compile(
            r"\b(?:i'?m|im|i am)\s+(?:\d{1,2}|" + _NUMWORD + r")\b(?!\s*(?:minutes|mins|"
            r"hours|hrs|days|feet|ft|miles|%|percent))|\byears? old\b|"
            r"\bturn(?:ed|ing|s)?\s+(?:\d{1,2}|" + _NUMWORD + r")\b",
        ),
    ),
    (
        "habit",
        2.0,
        re.compile(
            r"\b(?:once|twice|three times|\d+ times)\s+(?:a|per|every)\s+(?:day|week|month|year)\b|"
            r"\bevery\s+(?:single\s+|other\s+)?(?:morning|day|night|evening|week|weekend|month|"
            r"summer|winter|\w+day)\b|"
            r"\bsince\s+(?:19|20)\d\d\b|"
            r"\b(?:since|for)\s+(?:high school|college|middle school|years|ages|forever|"
            r"(?:a|\d+|" + _NUMWORD + r"|a few|a couple(?: of)?)\s+(?:years|months|decades))\b",
        ),
    ),
    (
        "request",
        2.0,
        re.compile(
            r"\b(?:i|we)\s+(?:really\s+|still\s+|just\s+)?(?:need|want|wanna|would like|'d like)"
            r"\s+(?:to\s+)?(?!(?:know|ask|say|see|talk|chat|hear|sleep|go to bed|cry|die)\b)\w+",
        ),
    ),
)
# Which kinds are about the speaker even without "I"/"my" (a fragment like "allergic to nuts").
_SELF_EVIDENT = frozenset({"health", "whereabouts", "name", "number", "event", "age"})
_SELF_EVIDENT_CUES = tuple(cue for cue in _CUES if cue[0] in _SELF_EVIDENT)
# Phrases that only make sense about the speaker's own affairs.
_IMPLIED_SPEAKER = re.compile(
    r"\b(?:can'?t wait|cant wait|so (?:stoked|excited|pumped|nervous)|note to self|"
    r"wish me luck|mark your calendars?|if anyone asks|nothing beats|looking forward to)\b"
)
_DATE = re.compile(
    r"\bin (?:a|one|two|three|four|five|six|a few|a couple of) (?:days|weeks|months)\b|"
    r"\b(?:mon|tues?|wed|thur?s?|fri|sat|sun)(?:day)?\b|\bweekend\b|"
    r"\b(?:january|february|march|april|june|july|august|september|october|november|december|"
    r"jan|feb|mar|apr|jun|jul|aug|sept?|oct|nov|dec)\b|\bmay\s+\d|"
    r"\b(?:today|tomorrow|tonight|tmrw|tmr|tomorow|christmas|xmas|thanksgiving|easter|"
    r"halloween|new year'?s|spring break|summer break|winter break|fall break)\b|"
    r"\b(?:next|last|this|coming)\s+(?:week|month|year|weekend|summer|winter|spring|fall|"
    r"autumn|morning|afternoon|evening|night|\w+day)\b|"
    r"\b\d{1,2}(?:st|nd|rd|th)\b|\b(?:the\s+)?" + _NUMWORD + r"(?:th)?\s+of\b|"
    r"\b\d{1,2}(?::\d\d)?\s?(?:am|pm|a\.m\.|p\.m\.)|\bo'?clock\b|\bnoon\b|\bmidnight\b|"
    r"\b\d{1,2}/\d{1,2}(?:/\d{2,4})?\b|\bin \d+ (?:days|weeks|months)\b"
)
_DROPPED_SUBJECT = re.compile(
    r"(?:just|still|also|finally|recently|born|raised|grew up|allergic|parked|moved|moving|"
    r"living|working|married|engaged|going|heading|flying|leaving|studying|been|got|getting|"
    r"gotta|have|had|need|love|loving|hate|started|finished|bought|turning|visiting|booked|"
    r"took|take|taking|play|playing|played|drive|driving|work|live|left|lost|found|planning|"
    r"hoping|trying|thinking|training|saving|learning|teaching|adopted|adopting|"
    r"(?:can't|cant|cannot|don't|dont|didn't|didnt|won't|wont|never)\s+[a-z]{3,})\b"
)
_LEANS_BACK = re.compile(
    r"(?:she|he|they|it|that|this|thats|that's|she's|he's|they're|it's|shes|hes|its)\b", _I
)
_ASKS_ITSELF = re.compile(r"(?:my|our)\s+(?:\w+\s+){0,2}\w+\s*\?$", _I)
_CLAUSE_START = re.compile(r"(?:i|i'm|im|i've|ive|i'd|i'll|we|we're|we've|my|our)$", _I)
_NUMBER = re.compile(r"\d|\b" + _NUMWORD + r"\b")
_PROPER = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]{2,}")
_WORD = re.compile(r"[\w'-]+")
MAX_WORDS = 24
SHORT_WORDS = 12
LENGTH_COST = 0.1  # score per word beyond SHORT_WORDS
_CLAUSE_BREAK = re.compile(
    r",\s+(?:and|but|so|because|though|which|cause|cuz|since)\s+|"
    r"\s+(?:but|because|cause|cuz|although|though|whereas)\s+|;\s+|\s+-\s+",
    _I,
)
THRESHOLD = 2.0
# A sentence no pattern recognizes can still hold a fact: "the pharmacy ran out of metformin
# again", "i swapped my civic for a used tacoma". It is kept as a *minor* fact when it names
# something specific (a word outside everyday chat vocabulary, see ``specific_words``) or
# speaks about the speaker with at least ``MINOR_WORDS`` content words, and its words are
# rare enough to tell something (``information``): everyday chat says many such sentences,
# and the summary's room is small. Its score grows with what it tells, so value per token
# prefers the dense ones. Minor facts score below ``THRESHOLD``, so below every recognized
# one, and a summary gives them only part of its room (see ``ExtractiveSummarizer``).
MINOR_WEIGHT = 0.5
MINOR_INFO = 0.5  # score per word's worth of ``information``
MINOR_CAP = 1.9  # below THRESHOLD: a minor fact never outranks a recognized one
# A minor fact must tell at least this much (a number, date or name counts 0.5): "i wonder
# when he went to bed" (0) is chat; "took up pottery over the winter" (1.0) and "left the
# bakery, working nights at the clinic now" (1.4) are not.
MIN_INFORMATION = 0.5
RARE_FROM = 0.45  # rarity above which a word tells something ("summer" 0.31, "therapy" 0.65)
MINOR_WORDS = 2
# Words that say nothing about the speaker, beyond the search's stopwords (English:
# ``chatctx/data/words/en.toml``): fillers, vague
# verbs and adjectives of chat, words typed without their apostrophe.
_VAGUE = word_list("facts", "vague")
# Words that say nothing: function words, fillers, vague chat words.
EMPTY_WORDS = STOPWORDS | _VAGUE


def _load_vocabulary() -> tuple[int, dict[str, int]]:
    """Everyday chat vocabulary: each word used in at least 5 of 6,890 short chats of a
    public chat corpus, with the number of chats it is in (bench/facts/build_common_words.py
    says how the list was made)."""
    text = files("chatctx").joinpath("data/common_words.txt").read_text(encoding="utf-8")
    head, _, body = text.partition("\n")
    pairs = (line.split() for line in body.splitlines() if line.strip())
    return int(head.split()[-1]), {word: int(count) for word, count in pairs}


_CHATS, _USED_IN = _load_vocabulary()
# A word's rarity, for every listed word; one outside the list has rarity 1.
_RARITY = {
    word: max(0.0, math.log(_CHATS / (used + 1)) / math.log(_CHATS))
    for word, used in _USED_IN.items()
}
# Someone or something other than the speaker that a sentence can be about.
_SOMEONE_ELSE = re.compile(
    r"\b(?:you|u|ur|your|yours|youre|he|him|his|hes|she|hers|shes|they|them|their|theirs|"
    r"theyre|it|its|that|thats|this|these|those|there|theres|here|someone|somebody|everyone|"
    r"everybody|people|who|what|which)\b"
)
_ALPHA = re.compile(r"[^\W\d_]+")


@dataclass(frozen=True, slots=True)
class Statement:
    """A first-person statement worth keeping: the clause as said and how much it matters."""

    text: str
    score: float
    kinds: tuple[str, ...]


def _spans(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, is an identifier) of the identifiers and values in ``text``, in order; of
    overlapping ones the longest. A value of five digits or more (a phone number, a date
    with its year, 38,000원) is an identifier too; a smaller one ("3박", "11시") is a value."""
    found = sorted(
        (
            (m.start(), m.end(), pattern is _IDENTIFIER)
            for pattern in (_IDENTIFIER, _VALUE)
            for m in pattern.finditer(text)
        ),
        key=lambda span: (span[0], -span[1]),
    )
    spans: list[tuple[int, int, bool]] = []
    for start, end, named in found:
        if not spans or start >= spans[-1][1]:
            digits = sum(c.isdigit() for c in text[start:end])
            if not named and digits >= 5 and text[start : end - 1].isdigit():
                end -= 1  # a long number's next letter is the sentence ("15908632217了")
            spans.append((start, end, named or digits >= 5))
    return spans


def identifiers(text: str) -> list[str]:
    """Identifiers in ``text`` in order of appearance (duplicates kept), then introduced
    names and, in other languages than English, quoted and capitalized ones."""
    found = [text[a:b] for a, b, named in _spans(text) if named]
    names: list[str] = []
    if not reads_as_english(text):  # English chat quotes words in passing ("so 'busy' lol")
        names += [next(g for g in m.groups() if g) for m in _QUOTED.finditer(text)]
        names += [m.group() for m in _CAPITALIZED.finditer(text)]
    return found + _INTRODUCED.findall(text) + names


def values(text: str) -> list[str]:
    """The small values of ``text`` that are not identifiers: a time, a date without its
    year, a count with its unit ("14:30", "3/14", "3박", "11시"). They make a sentence worth
    keeping, not a fact on their own."""
    return [text[a:b] for a, b, named in _spans(text) if not named]


def value_shape(value: str) -> str:
    """What values of one kind share: the value with each run of digits as one ``0``
    ("7일" and "22일": "0일"; "8:30" and "7:45": "0:0"; "3月" and "11月": "0月")."""
    return _DIGITS.sub("0", value.casefold())


def _near(text: str, start: int, end: int) -> tuple[list[str], list[str]]:
    """The search terms right before and right after ``text[start:end]`` in its clause,
    nearest first: up to ``NEAR_TERMS`` on each side, within ``NEAR_CHARS`` characters where
    the script has no spaces between words; numbers left out (a neighbouring value's)."""
    left = _CLAUSE_MARK.split(text[max(0, start - NEAR_SPAN) : start])[-1]
    right = _CLAUSE_MARK.split(text[end : end + NEAR_SPAN])[0]
    if unspaced(left):
        left = left[-NEAR_CHARS:]
    if unspaced(right):
        right = right[:NEAR_CHARS]
    return _terms(reversed(left.split()), backwards=True), _terms(right.split())


def _terms(words: Iterable[str], *, backwards: bool = False) -> list[str]:
    """The first ``NEAR_TERMS`` search terms of ``words`` in their order (each word's terms
    last first where ``backwards``), numbers left out."""
    out: list[str] = []
    for word in words:
        terms = query_terms(word)
        for term in reversed(terms) if backwards else terms:
            if not term.isdigit() and term not in out:
                out.append(term)
        if len(out) >= NEAR_TERMS:
            break
    return out[:NEAR_TERMS]


@functools.lru_cache(maxsize=4096)
def _valued(text: str) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]:
    """(value, shape, terms right before it and after it, nearest first) of each small value
    in ``text`` (cached: recall asks again of the same messages at every turn)."""
    out = []
    for a, b, named in _spans(text):
        if not named:
            before, after = _near(text, a, b)
            out.append((text[a:b], value_shape(text[a:b]), tuple(before), tuple(after)))
    return tuple(out)


def value_keys(text: str) -> set[tuple[str, str]]:
    """(shape, nearest word before it) of each small value in ``text``: another message
    gives one of them anew (``replaced``) only if it holds a value with the same key."""
    return {(shape, before[0]) for _, shape, before, _ in _valued(text) if before}


def replaced(earlier: str, later: str) -> list[tuple[str, str]]:
    """(old, new) for each small value (``values``) of ``earlier`` that ``later`` gives
    anew: a different value of the same shape (``value_shape``) whose nearest word before
    it is the same ("매달 7일" then "매달 22일"; "下午5点" then "下午4点"); each new value
    replaces the old one it shares most nearby words with. Found from how values are
    written and the words next to them, in any language; a value said again as it was
    replaces nothing. Identifiers are left out: a second order number or e-mail address is
    as often another one as a new one. It is a guess: two values of one kind named by the
    same word ("a las 9:00", "a las 18:00" for opening and closing) read as a change too, so
    callers use it to keep and order text, never to tell the model a value is void."""
    old = _valued(earlier)
    if not old:
        return []
    new = _valued(later)
    kept = {value for value, _, _, _ in new}
    pairs: list[tuple[str, str]] = []
    taken: set[str] = set()
    for other, shape, before, after in new:
        if not before:
            continue
        shared, best = max(
            (
                (len(set(before) & set(old_before)) + len(set(after) & set(old_after)), value)
                for value, old_shape, old_before, old_after in old
                if old_shape == shape
                and old_before[:1] == before[:1]
                and value not in kept
                and value not in taken
            ),
            default=(0, ""),
        )
        if shared:
            taken.add(best)
            pairs.append((best, other))
    return pairs


def fact_set(summary: str) -> set[str]:
    """The facts a summary already holds, parsed: items of its ``Facts:`` lines plus every
    identifier written anywhere in it. Compared exactly, so ``NH-4821`` is not "already
    there" because ``NH-48213`` is."""
    found: set[str] = set()
    for line in summary.splitlines():
        if line.startswith(FACTS_PREFIX):
            found.update(f.strip() for f in line[len(FACTS_PREFIX) :].split("; ") if f.strip())
    found.update(identifiers(summary))
    return found


def line_key(text: str) -> str:
    """What two statements must share to be the same: their words, case-folded."""
    return " ".join(_WORD.findall(text.casefold()))


def specific_words(said: str) -> int:
    """How many different words of ``said`` are specific: outside everyday chat vocabulary
    (``chatctx/data/common_words.txt``) and not fillers, e.g. "propranolol", "Poughkeepsie",
    "bouldering", but not "class", "pizza" or "tired"."""
    words = {word.casefold() for word in _ALPHA.findall(said)}
    return sum(1 for w in words if len(w) > 2 and w not in EMPTY_WORDS and w not in _RARITY)


def reads_as_english(said: str) -> bool:
    """Whether most words of ``said`` are everyday English chat words (``_RARITY``'s, or
    function words): what the statement patterns and ``rarity`` can read. In another language
    every word is unknown, so would look rare and tell much; there a sentence is kept for the
    values it holds (``identifiers``) and found by meaning (recall), not by these."""
    words = [w.casefold() for w in _ALPHA.findall(said)]
    known = sum(1 for w in words if w in _RARITY or w in EMPTY_WORDS)
    return known * 2 >= len(words)


def rarity(word: str) -> float:
    """How rare a case-folded word is in everyday chat, from 0 (in every chat) to 1 (in none
    of the counted ones): the share of the chats' log-count it takes to find it,
    ``log(N / (chats with it + 1)) / log(N)``. "went" 0.27, "summer" 0.31, "therapy" 0.65,
    "propranolol" 1."""
    return _RARITY.get(word, 1.0)


def information(low: str) -> float:
    """What a case-folded sentence tells, in words' worth: each different content word
    counts for how much rarer it is than everyday chat (``rarity`` above ``RARE_FROM``,
    scaled to 0..1). "i wonder when he went to bed" 0, "took up pottery over the
    winter, hooked now" 1.4."""
    words = {w for w in _ALPHA.findall(low) if len(w) > 2 and w not in EMPTY_WORDS}
    return sum(max(0.0, rarity(w) - RARE_FROM) / (1.0 - RARE_FROM) for w in words)


def _content_words(low: str) -> int:
    """How many different words of ``low`` say something: not function words, fillers or
    numbers."""
    return len({w for w in _ALPHA.findall(low) if len(w) > 2 and w not in EMPTY_WORDS})


def _tidy(sentence: str) -> str:
    text = _TRAIL.sub("", _LEAD.sub("", sentence))
    return text.strip(" ,;:-")


def statement(sentence: str) -> Statement | None:
    """``sentence`` as a statement worth keeping, or None (questions, chit-chat, no first
    person, nothing durable). Long sentences should come through :func:`sentences` first."""
    said = " ".join(sentence.translate(_APOSTROPHES).split()[:MAX_WORDS])
    if not reads_as_english(said):
        return None  # the patterns and word counts below are English's
    text = _tidy(said)
    low = text.lower()  # the patterns are lower case: matching without IGNORECASE is 2x faster
    words = low.split()
    if len(text) < 6 or _QUESTION.search(low) or len(set(words)) * 2 < len(words):
        return None  # a question, too short, or the same words over and over
    said_low = said.lower()
    # Chat drops the subject ("just bought a prius", "born and raised in X"): it is "I".
    probe = f"i {low} / {said_low}" if _DROPPED_SUBJECT.match(low) else said_low
    # Without a first-person speaker only the kinds that are about the speaker anyway count;
    # checking that first skips most patterns on most chat lines.
    speaker = _ANCHOR.search(probe) is not None or _IMPLIED_SPEAKER.search(probe) is not None
    cues = _CUES if speaker else _SELF_EVIDENT_CUES
    kinds = [(weight, kind) for kind, weight, pattern in cues if pattern.search(probe)]
    specific = specific_words(said)
    score = 0.0
    detail = 1.5 if _DATE.search(said_low) else 1.0 if _NUMBER.search(said_low) else 0.0
    proper = 0.5 if _PROPER.search(said) else 0.0
    if kinds:
        kinds.sort(key=lambda k: -k[0])
        score = kinds[0][0] + min(1.0, 0.5 * (len(kinds) - 1)) + detail + proper
        # What is specific is what a later question needs; a pattern match with nothing
        # specific, no number, date or name ("i like learning") is worth less.
        score += 0.5 * min(2, specific) if specific else (0.0 if detail or proper else -0.5)
        if score < THRESHOLD:
            kinds = []  # kept as a minor fact below
    recognized = score > 0
    if not kinds:
        # Chat drops the "I": a line about nobody else ("new job at the bakery, starts
        # monday") is the speaker's own.
        about_speaker = speaker or _SOMEONE_ELSE.search(low) is None
        content = about_speaker and _content_words(low) >= MINOR_WORDS
        if not (specific or content or recognized or proper):  # a name is specific too
            return None
        told = information(low) + (0.5 if detail or proper else 0.0)
        if told < MIN_INFORMATION and not recognized:
            return None
        score = min(MINOR_CAP, MINOR_WEIGHT + MINOR_INFO * told + (0.25 if speaker else 0.0))
        kinds = [(score, "minor")]
    if len(text.split()) > SHORT_WORDS:  # keep the clause that says it, not the whole ramble
        for piece in _CLAUSE_BREAK.split(text):
            if len(piece.split()) >= 2 and any(p.search(piece.lower()) for _, _, p in _CUES):
                text = piece.strip(" ,;:-")
                break
    if len(text.split()) < 2:
        return None
    # A summary holds few tokens: at equal worth, the shorter statement is the better buy.
    score = max(0.5, score - LENGTH_COST * max(0, len(text.split()) - SHORT_WORDS))
    return Statement(text=text, score=score, kinds=tuple(k[1] for k in kinds))


def _pieces(sentence: str) -> list[str]:
    """A run-on chat line cut into clauses where the speaker starts a new one ("... now we
    just moved to ..."), pieces of at most ``MAX_WORDS`` words."""
    words = sentence.split()
    if len(words) <= MAX_WORDS:
        return [sentence]
    out: list[list[str]] = [[]]
    for word in words:
        new_clause = _CLAUSE_START.match(word) is not None and len(out[-1]) >= 4
        if new_clause or len(out[-1]) >= MAX_WORDS:
            out.append([])
        out[-1].append(word)
    return [" ".join(piece) for piece in out if piece]


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence or chat line of ``text`` as ``sentences`` splits it
    (abbreviations such as "Dr." end none), with the whitespace that follows it."""
    spans, start = [], 0
    for m in _SENTENCE.finditer(text):
        if m.end() > start:
            spans.append((start, m.end()))
            start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def sentences(text: str) -> list[str]:
    """Sentences and chat lines of ``text``, whitespace collapsed, run-ons cut in clauses."""
    out: list[str] = []
    for part in _SENTENCE.split(text.translate(_APOSTROPHES)):
        part = " ".join(part.split())
        if part:
            out += _pieces(part)
    return out


def statements(text: str) -> list[Statement]:
    """The first-person statements of one user message worth keeping, in order.

    A sentence that leans on the one before ("Rosa says hi. she's my aunt") is judged
    together with it, and so is a short question answered right after ("my job? welder.").
    """
    out: list[Statement] = []
    parts = sentences(text)
    for i, sentence in enumerate(parts):
        if (
            i > 0
            and _LEANS_BACK.match(sentence)
            and len(f"{parts[i - 1]} {sentence}".split()) <= MAX_WORDS
        ):
            sentence = f"{parts[i - 1]} {sentence}"
        elif _ASKS_ITSELF.match(sentence) and i + 1 < len(parts):
            continue  # judged with its answer, next
        if i > 0 and _ASKS_ITSELF.match(parts[i - 1]):
            sentence = f"{parts[i - 1]} {sentence}"
        found = statement(sentence.replace("? ", ": ", 1) if "? " in sentence else sentence)
        if found is not None and not (out and out[-1].text.endswith(found.text)):
            out.append(found)
    return out


def statement_score(text: str) -> float:
    """The score a kept line's text gets again when the summary is compacted (0 if none)."""
    found = statement(text)
    return found.score if found is not None else 0.0
