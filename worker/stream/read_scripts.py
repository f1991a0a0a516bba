"""The worker's reads of the input stream, as Lua scripts that measure every entry in Redis before it is sent.

Why: XREADGROUP and XAUTOCLAIM hand over whatever a producer wrote. A few hundred entries of 10-100 MB made one
window's reply many GB and the worker ran out of memory; restarted, it re-read the same pending entries and ran out
again (a poison crash loop no delivery count could end, since it died before writing a dead letter). Here each entry
is read on its own (COUNT 1, XRANGE of one id: Redis itself then holds one entry's copy at a time, not a window's),
its field names and values are measured, and it is handed over

* whole, when it is at most ``entry_max`` bytes (``messages.entry_max_bytes``: text + subject and meta at their
  limit, and room for the rest), or
* as a *marker*: its size, field count and, for its first 32 fields, the name (its first 64 bytes), the value's
  size and its first bytes (``string.sub``: the fields share ``excerpt`` bytes, an ``id`` gets at least 256, all a
  valid id has), so the worker dead-letters it without ever holding it. A marker is never larger than its entry.

A read stops once the entries it looked at (whole or not, each at its full size) reach the byte budget
(TRIAGE_READ_MAX_BYTES), after at least one: the reply is at most the budget plus one entry or one marker, and a
script's own time in Redis is bounded the same way. Scripts cannot block: the wait for new entries polls
(``source.StreamSource.read_new``).

An unread entry's copy is garbage once its marker is made. A full collection frees it once ``GC_BYTES`` of such
copies are garbage, not after each one: a full collection walks everything the read holds, so one per marker made
a read of many medium entries (1,637 markers of 100 KB, 40 fields each) cost Redis almost twice its time (docs/
worker.md, "Read size"). Lua holds at most ``GC_BYTES`` of copies beside the entry being measured.

Each script touches only KEYS[1], the input stream: like all the worker's scripts it names no key it was not given
(what Redis Cluster routes by). The three reads take ARGV[1] budget, ARGV[2] entry_max, ARGV[3] excerpt bytes,
ARGV[4] group, ARGV[5] consumer, then their own; entries come back as flat triples: id, times delivered (this
delivery included), fields (flat; false when deleted) or marker.
"""

from __future__ import annotations

from worker.stream.scripts import Script

GC_BYTES = 8 * 2**20  # copies of unread entries Lua may hold as garbage before a full collection

_HAND = (
    r"""
local stream, group, consumer = KEYS[1], ARGV[4], ARGV[5]
local budget, entry_max, excerpt = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local used, whole, unread = 0, {}, {}  -- bytes looked at; entries handed over whole; markers
local garbage = 0  -- bytes of unread entries' copies not collected yet
-- hand one entry over, whole or as a marker; true when it was a marker (its copy is garbage: ``collect``)
local function hand(id, times, flat)
  local size = 0
  for j = 1, #flat do size = size + #flat[j] end
  used = used + size
  if size <= entry_max then
    whole[#whole + 1] = id
    whole[#whole + 1] = times
    whole[#whole + 1] = flat
    return false
  end
  local nf = math.min(#flat / 2, 32)
  local m, share = {size, #flat / 2}, math.floor(excerpt / nf)
  for j = 1, 2 * nf, 2 do
    m[#m + 1] = string.sub(flat[j], 1, 64)
    m[#m + 1] = #flat[j + 1]
    m[#m + 1] = string.sub(flat[j + 1], 1, flat[j] == 'id' and math.max(share, 256) or share)
  end
  unread[#unread + 1] = id
  unread[#unread + 1] = times
  unread[#unread + 1] = m
  garbage = garbage + size
  return true
end
-- after a marker, its copy dropped: a full collection once GC_BYTES of copies are garbage (each collection walks
-- all the read holds; one per marker cost a read of many medium entries about as much as copying them)
local function collect()
  if garbage >= """
    + str(GC_BYTES)
    + r""" then
    collectgarbage()
    garbage = 0
  end
end
"""
)

READ_NEW = (
    _HAND
    + r"""
-- Entries never delivered to anyone (XREADGROUP >), one at a time. ARGV[6] how many at most.
-- Returns {whole, markers, bytes looked at}.
local count, n = tonumber(ARGV[6]), 0
while n < count and used < budget do
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', '1', 'STREAMS', stream, '>')
  if not r then break end
  local e = r[1][2][1]
  if not e then break end  -- no entry in the reply: nothing more to hand over (no Redis since 6.0 sends this)
  local big = hand(e[1], 1, e[2])
  r, e = nil, nil
  if big then collect() end
  n = n + 1
end
return {whole, unread, used}
"""
)

READ_OWN = (
    _HAND
    + r"""
-- Hand this consumer its own pending entries again (at start, after a reconnect or a recreated group), except
-- those it still holds: XREADGROUP <id> would count a delivery for every pending entry, held ones included, so a
-- few Redis blips during one long window would push a healthy ticket past TRIAGE_MAX_DELIVERIES. Each entry handed
-- out is XCLAIMed by its owner with RETRYCOUNT + 1 (a delivery counted, as a restart must count it; JUSTID: its
-- fields come from the XRANGE that measured it, not a second copy); one deleted from the stream is returned
-- without fields and left pending (XCLAIM would drop it), so the worker dead-letters and acks it.
-- ARGV[6] start ('-' or '(<id>'), ARGV[7] page size, ARGV[8..] the ids it holds.
-- Returns {where the next page starts after ('' when this was the last), whole, markers}.
local count, last = tonumber(ARGV[7]), nil
local held = {}
for k = 8, #ARGV do held[ARGV[k]] = true end
local page = redis.call('XPENDING', stream, group, ARGV[6], '+', count, consumer)  -- NOGROUP raises here
for _, row in ipairs(page) do
  if used >= budget then break end
  local id, times = row[1], row[4]
  if not held[id] then
    local got = redis.call('XRANGE', stream, id, id)
    if got[1] then
      redis.call('XCLAIM', stream, group, consumer, 0, id, 'RETRYCOUNT', times + 1, 'JUSTID')
      local big = hand(id, times + 1, got[1][2])
      got = nil
      if big then collect() end
    else
      whole[#whole + 1] = id
      whole[#whole + 1] = times
      whole[#whole + 1] = false
    end
  end
  last = id
end
local cursor = ''
if last and (#page == count or last ~= page[#page][1]) then cursor = last end
return {cursor, whole, unread}
"""
)

CLAIM = (
    _HAND
    + r"""
-- XAUTOCLAIM, measured: entries of any consumer idle at least ARGV[6] ms from ARGV[7] ('0-0', an id or '(<id>'),
-- ARGV[8] at most. XAUTOCLAIM itself would return them all whole; here each is looked at with XRANGE, then XCLAIMed
-- with RETRYCOUNT + 1 and JUSTID (the delivery XAUTOCLAIM counts, without a second copy). An entry deleted from the
-- stream is XCLAIMed with JUSTID, which drops it from the pending list as XAUTOCLAIM does (no other worker meets it
-- again; Redis 6.2 keeps it, on this consumer, until its dead letter acks it), and returned by id for its dead
-- letter; except one pending on this consumer that it holds (ARGV[9..], as READ_OWN's): its window writes its one
-- record (the refresh leaves a deleted entry idle). Claimed as an orphan, its dead letter (written without an
-- ownership check) and its window's settle both wrote one on 6.2, whose XCLAIM left it ours in between.
-- Only what was looked at is claimed: the rest stays with its consumer for the next call.
-- Returns {next cursor ('0-0': scan complete), whole, markers, deleted ids}.
local count, last, deleted = tonumber(ARGV[8]), nil, {}
local held = {}
for k = 9, #ARGV do held[ARGV[k]] = true end
local page = redis.call('XPENDING', stream, group, 'IDLE', ARGV[6], ARGV[7], '+', count)  -- NOGROUP raises here
for _, row in ipairs(page) do
  if used >= budget then break end
  local id = row[1]
  local got = redis.call('XRANGE', stream, id, id)
  if got[1] then
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'RETRYCOUNT', row[4] + 1, 'JUSTID')
    local big = hand(id, row[4] + 1, got[1][2])
    got = nil
    if big then collect() end
  elseif row[2] == consumer and held[id] then
    -- ours, in a window we hold: left pending on us for that window's settle
  else
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
    deleted[#deleted + 1] = id
  end
  last = id
end
local cursor = '0-0'
if last and (#page == count or last ~= page[#page][1]) then cursor = '(' .. last end
return {cursor, whole, unread, deleted}
"""
)

ANY_AFTER = r"""
-- Whether the stream has an entry after ARGV[1] (an id): 1 or 0, never the entry (--drain's last check).
return #redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', 1)
"""

read_new_script = Script(READ_NEW)
any_after_script = Script(ANY_AFTER)
read_own_script = Script(READ_OWN)
claim_script = Script(CLAIM)
