-- Argo CD health check for serving.tokenmill.dev/InferenceService.
-- Reads only the kstatus-style status the operator writes: status.observedGeneration and
-- conditions Ready, Reconciling, Stalled, Sized (each may carry its own observedGeneration).
local hs = {}
local generation = obj.metadata.generation

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

-- A status written for an older spec says nothing about the current one.
local observed = obj.status.observedGeneration
if observed == nil or (generation ~= nil and observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = {}
for _, c in ipairs(obj.status.conditions) do
  -- Skip conditions left over from an older generation.
  if c.type ~= nil and (c.observedGeneration == nil or generation == nil or c.observedGeneration >= generation) then
    conditions[c.type] = c
  end
end

local function describe(c)
  local text = c.type
  if c.reason ~= nil and c.reason ~= "" then text = text .. " (" .. c.reason .. ")" end
  if c.message ~= nil and c.message ~= "" then text = text .. ": " .. c.message end
  return text
end

-- Degraded first: neither a stalled reconcile nor a model that does not fit will fix itself.
local stalled = conditions["Stalled"]
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end
local sized = conditions["Sized"]
if sized ~= nil and sized.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(sized)
  return hs
end

local reconciling = conditions["Reconciling"]
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling)
  return hs
end

local ready = conditions["Ready"]
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready)
else
  hs.message = "Waiting for the Ready condition"
end
return hs
